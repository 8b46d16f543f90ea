"""Start a training job: under torchrun each launched rank runs it; otherwise ``nproc`` local ranks are
started with torch's elastic launcher (one rank in this process when the mesh has one rank)."""

from __future__ import annotations

from .config import Config, from_dict


def rank_main(cfg_dict: dict, resume: bool) -> dict:
    """One rank's job (module level, so the launcher can start it in a fresh process)."""
    from .loop import Trainer

    cfg = from_dict(cfg_dict)
    result = Trainer(cfg).fit(resume=resume)
    return result


def run_training(cfg: Config, nproc: int | None = None, resume: bool = False) -> dict:
    """Train with ``cfg`` on dp x domain ranks; returns rank 0's result (losses, evaluation, paths)."""
    from domainflow.launch import launch_local, under_launcher

    need = cfg.mesh.size
    if nproc is not None and nproc != need:
        from .config import ConfigError

        raise ConfigError(f"--nproc {nproc} does not match mesh.dp x mesh.domain x mesh.lon = {cfg.mesh.dp} x "
                          f"{cfg.mesh.domain} x {cfg.mesh.lon} = {need}; set --dp/--domain (or mesh.dp / mesh.domain / "
                          f"mesh.lon) so their product is {nproc}")
    if under_launcher() or need == 1:
        return rank_main(cfg.to_dict(), resume)
    results = launch_local(rank_main, need, cfg.to_dict(), resume)
    return results[0]
