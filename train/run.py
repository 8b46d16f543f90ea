"""Start a training job: under torchrun each launched rank runs it; otherwise ``nproc`` local ranks are
started with torch's elastic launcher (one rank in this process when the mesh has one rank)."""

from __future__ import annotations

from pathlib import Path

from .config import Config, from_dict

# what a training, prediction or forecast rank imports (torch._dynamo: torch.optim's optimizers do), imported once
# in the launcher's fork server rather than in every rank
RANK_MODULES = ("torch._dynamo", "zarr", "domainflow.dispatch.engine", "domainflow.ops", "domainflow.train.loop",
                "domainflow.train.predict", "domainflow.train.forecast")
# what a rank's first domainflow.compile call imports (AOTAutograd and its partitioner, Dynamo's backends,
# Inductor's front end, which the graph check's backend wraps even for aot_eager): about 600 modules, 1 s of CPU
# per rank here; preloaded with train.compile=true and predict --compile only (0.8 s in the one fork server)
COMPILE_MODULES = ("torch._inductor.compile_fx", "torch._functorch.aot_autograd", "torch._functorch.partitioners",
                   "torch._dynamo.backends.common", "torch._dynamo.backends.debugging", "torch._dynamo.backends.inductor",
                   "torch._dynamo.backends.distributed", "torch._dynamo.repro.after_dynamo",
                   "torch._functorch._aot_autograd.subclass_codegen", "torch.fx.experimental.validator",
                   "torch._inductor.compiler_bisector", "torch._subclasses.schema_check_mode", "networkx",
                   "torch.export._trace")


def rank_main(cfg_dict: dict, resume: bool, init_from: str | None = None, overwrite: bool = False,
              claimed: bool = False) -> dict:
    """One rank's job (module level, so the launcher can start it in a fresh process); ``claimed``: the process
    that started the ranks holds the output folder's lock."""
    from .loop import Trainer

    cfg = from_dict(cfg_dict)
    result = Trainer(cfg).fit(resume=resume, init_from=init_from, overwrite=overwrite, claimed=claimed)
    return result


def run_training(cfg: Config, nproc: int | None = None, resume: bool = False, init_from: str | None = None,
                 overwrite: bool = False) -> dict:
    """Train with ``cfg`` on dp x domain ranks; returns rank 0's result (losses, evaluation, paths). ``resume``:
    continue this run from its latest checkpoint; ``init_from``: start from another checkpoint's weights;
    ``overwrite``: replace a training already in the output folder (refused otherwise)."""
    from domainflow.launch import launch_local, under_launcher

    from . import output_folder

    need = cfg.mesh.size
    if nproc is not None and nproc != need:
        from .config import ConfigError

        raise ConfigError(f"--nproc {nproc} does not match mesh.dp x mesh.domain x mesh.lon = {cfg.mesh.dp} x "
                          f"{cfg.mesh.domain} x {cfg.mesh.lon} = {need}; set --dp/--domain (or mesh.dp / mesh.domain / "
                          f"mesh.lon) so their product is {nproc}")
    if under_launcher():  # torchrun's ranks: rank 0 takes the output folder
        return rank_main(cfg.to_dict(), resume, init_from, overwrite)
    lock = output_folder.claim(cfg.output.dir, resume, overwrite, init_from)  # held while the ranks run
    try:
        preflight(cfg, resume, init_from)
        if need == 1:
            return rank_main(cfg.to_dict(), resume, init_from, overwrite, claimed=True)
        return launch_local(rank_main, need, cfg.to_dict(), resume, init_from, overwrite, True,
                            preload=RANK_MODULES + (COMPILE_MODULES if cfg.train.compile else ()))[0]
    finally:
        if lock is not None:
            lock.release()


def preflight(cfg: Config, resume: bool, init_from: str | None = None) -> None:
    """The errors a job can know before any rank starts: the store (complete, of the right kind, with the
    fields, inputs, splits and parts the config asks for); with ``resume``, a checkpoint of this same run to
    resume from; with ``init_from``, a checkpoint whose channels fit the store. Raised here, they are one line
    instead of one traceback per rank."""
    from domainflow.readers import open_store
    from domainflow.readers.mesh_dataset import check_request

    from . import checkpoint as ckpt
    from .config import ConfigError

    d = cfg.data
    if not d.store:
        raise ConfigError("data.store is not set; give the path of an ingested store (domainflow ingest ...)")
    store = open_store(d.store)
    try:
        store.require_kind(d.kind)
        if d.kind == "mesh":
            from .data import check_edges

            check_edges(cfg, store)
            check_request(store, d.location, d.fields, d.inputs, store.runs("train"), cfg.mesh.domain, edges=d.edges)
            if cfg.train.compile:  # a run with fewer points than the draw is read whole, at its own size
                from domainflow.readers.mesh_dataset import smallest_run

                run, points = smallest_run(store, d.location, store.runs("train"))
                if points < d.sample_points:
                    raise ConfigError(f"train.compile=true with data.sample_points={d.sample_points}: the training "
                                      f"run {run} has only {points} points, so it is read whole and would compile "
                                      f"anew; set data.sample_points={points} or fewer")
            store.runs(d.val_split)
            if d.use_params:
                from .data import check_params

                check_params(store)
        else:
            missing = [s for s in ("train", d.val_split) if s not in store.splits]
            if missing:
                raise ConfigError(f"{store.path} has no split(s) {missing}; its splits are {sorted(store.splits)}")
        if resume or init_from:
            _check_start(cfg, store, resume, init_from)
    finally:
        store.close()
    from .loggers import check_available

    check_available(cfg.output.loggers)
    if cfg.model.target:  # importable, and the kwargs are its parameters
        from . import model_target

        model = model_target.resolve(cfg.model.target)
        model_target.check_kwargs(cfg.model.target, model, cfg.model.kwargs)
        if cfg.data.kind == "mesh":
            model_target.check_edges_fit(cfg, model.forward)
    if resume:
        folder = Path(cfg.output.dir) / "checkpoints"
        try:
            found = ckpt.latest(folder)
        except ckpt.CheckpointError:
            found = True  # a damaged latest: the ranks fall back to an older one, or say why none works
        if found is None:
            raise FileNotFoundError(f"--resume: no checkpoint under {folder}; start without --resume")


def _check_start(cfg: Config, store, resume: bool, init_from: str | None) -> None:
    """A resume continues a checkpoint of the same run (named differences otherwise); --init-from names a
    checkpoint whose channels fit ``store``."""
    from . import checkpoint as ckpt
    from . import normalization, run_identity

    source = Path(cfg.output.dir) / "checkpoints" if resume else Path(init_from)
    head = ckpt.head_meta(source)
    if head is None:
        if resume:
            return  # said below: no checkpoint to resume from
        raise FileNotFoundError(f"--init-from {init_from}: no checkpoint there (expected a step_<n> folder or a "
                                f"checkpoints folder with one)")
    here = normalization.from_store(cfg, store)
    if resume:
        run_identity.check_same(head, run_identity.identity(cfg, here), source, here)
    else:
        run_identity.check_init_from(head, run_identity.identity(cfg, here), cfg, source)
    if head.get("normalization") is not None:
        normalization.check_fits(head["normalization"], store, cfg, f"the checkpoint under {source}")
