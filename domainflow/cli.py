"""The ``domainflow`` command."""

from __future__ import annotations

import argparse
import sys


def _demo(args) -> int:
    from .demo import rank_main, report
    from .launch import launch_local, under_launcher

    call = (args.points, args.steps, args.lr, args.split, args.out)
    if under_launcher():
        res = rank_main(*call)
        return report(res, args.out) if res.get("rank") == 0 else 0
    results = launch_local(rank_main, args.nproc, *call)
    return report(results[0], args.out)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="domainflow", description="Domain-parallel scientific ML.")
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="train a per-point model on a sharded surface, checked against one process")
    demo.add_argument("--nproc", type=int, default=2, help="local ranks to start (default 2)")
    demo.add_argument("--points", type=int, default=6000)
    demo.add_argument("--steps", type=int, default=150)
    demo.add_argument("--lr", type=float, default=3e-3)
    demo.add_argument("--split", type=float, default=0.62, help="fraction of points on rank 0 (uneven shards)")
    demo.add_argument("--out", default="demo_output")
    args = parser.parse_args(argv)
    if args.command == "demo":
        return _demo(args)
    return 2


if __name__ == "__main__":
    sys.exit(main())
