"""The ``domainflow`` command: it assembles the subsystems' subcommands (``domainflow.train.cli``: demo, train,
estimate, predict; ``domainflow.preprocess.cli``: synth, ingest, inspect; here: selfcheck) and turns a user's error
into one line (``DOMAINFLOW_TRACEBACK=1`` shows the traceback)."""

from __future__ import annotations

import argparse
import os
import sys


def _selfcheck(args) -> int:
    from domainflow.launch import launch_local, under_launcher
    from domainflow.app.selfcheck import rank_main, report

    call = (args.points, args.steps, args.lr, args.split, args.out)
    if under_launcher():
        res = rank_main(*call)
        return report(res, args.out) if res.get("rank") == 0 else 0
    results = launch_local(rank_main, args.nproc, *call, preload=("domainflow.dispatch.engine", "domainflow.ops"))
    return report(results[0], args.out)


def _add_selfcheck(sub) -> None:
    check = sub.add_parser("selfcheck", help="train a per-point model on a sharded surface, compared with one "
                                             "process after every step")
    check.add_argument("--nproc", type=int, default=2, help="local ranks to start (default 2)")
    check.add_argument("--points", type=int, default=6000)
    check.add_argument("--steps", type=int, default=150)
    check.add_argument("--lr", type=float, default=3e-3)
    check.add_argument("--split", type=float, default=0.62, help="fraction of points on rank 0 (uneven shards)")
    check.add_argument("--out", default="selfcheck_output")
    check.set_defaults(handler=_selfcheck, errors_are_bugs=True)


def main(argv=None) -> int:
    from domainflow.preprocess import cli as data_cli
    from domainflow.train import cli as train_cli

    parser = argparse.ArgumentParser(prog="domainflow", description="Domain-parallel scientific ML.")
    sub = parser.add_subparsers(dest="command", required=True)
    train_cli.add_demo(sub)
    _add_selfcheck(sub)
    train_cli.add_commands(sub)
    data_cli.add_commands(sub)
    sub.metavar = "{" + ",".join(c for c in sub.choices if c not in train_cli.HIDDEN_COMMANDS) + "}"  # aliases unlisted
    args, extra = parser.parse_known_args(argv)
    if extra and getattr(args, "overrides_anywhere", False) and all("=" in e and not e.startswith("-") for e in extra):
        args.overrides = list(args.overrides) + extra  # overrides given after options
    elif extra:
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    try:
        return args.handler(args)
    except KeyboardInterrupt:
        print(getattr(args, "interrupted", "interrupted"), file=sys.stderr)
        return 130
    except (ValueError, RuntimeError, OSError) as exc:
        from domainflow.preprocess.errors import IngestError

        # selfcheck's own failures are bugs (their traceback is the news); its data errors are the user's
        if (getattr(args, "errors_are_bugs", False) and not isinstance(exc, IngestError)) \
                or os.environ.get("DOMAINFLOW_TRACEBACK"):
            raise
        print(f"error: {exc}", file=sys.stderr)
        hint = data_cli.after_error(exc)
        if hint:
            print(hint, file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
