"""domainflow: domain parallelism for scientific ML.

Split the input domain (grid rows, mesh points) of one sample across ranks; ``ShardTensor`` carries
each rank's uneven chunk and a dispatch engine adds the collectives each op needs, so an unmodified
PyTorch model gives the single-device answer.
"""

# Names load on first use (PEP 562), so that ``import domainflow.preprocess`` in an ingest worker does not
# pay for importing torch; the first access to any of them loads the engine and its built-in handlers.
_EXPORTS = {
    "CollectiveError": "errors", "DomainflowError": "errors", "ShardingMismatchError": "errors",
    "ShardingShapeError": "errors", "UnsupportedShardedOp": "errors", "fallback": "fallback",
    "init_mesh": "mesh", "Partial": "placements", "Placement": "placements", "Replicate": "placements",
    "Shard": "placements", "REGISTRY": "registry", "register_aten": "registry", "register_function": "registry",
    "ShardTensor": "shard_tensor", "distribute_tensor": "shard_tensor", "scatter_tensor": "shard_tensor",
    "ShardSpec": "spec", "deferred_param_grads": "param_grads", "reduce_partials": "partials",
    "knn": "neighbours", "radius": "neighbours", "checkpoint": "activation_checkpoint",
    "ReplicaMismatchError": "errors", "sync_module": "consistency",
}
_SUBMODULES = ("comm", "ops", "shapes", "dispatch", "redistribute", "launch", "spec", "neighbours", "point_search",
               "consistency", "locks")


def _bind_exports():
    """Bind every exported name (called once the engine has loaded). Also undoes Python's binding of a
    submodule over an export of the same name (``domainflow.fallback`` the module vs the function)."""
    import importlib

    for export, module in _EXPORTS.items():
        mod = importlib.import_module("." + module, __name__)
        if hasattr(mod, export):  # a module still being imported (it imported the engine) binds on first use
            globals()[export] = getattr(mod, export)


def __getattr__(name):
    import importlib

    if name in _EXPORTS:
        importlib.import_module(".shard_tensor", __name__)  # the engine, dispatch and built-in handlers
        _bind_exports()
        return globals()[name]
    if name in _SUBMODULES:
        return importlib.import_module("." + name, __name__)
    raise AttributeError(f"module 'domainflow' has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(_EXPORTS) | set(_SUBMODULES))


__all__ = [
    "checkpoint", "CollectiveError", "DomainflowError", "Partial", "Placement", "REGISTRY", "Replicate", "Shard",
    "ShardSpec", "ShardTensor", "ShardingMismatchError", "ShardingShapeError", "UnsupportedShardedOp",
    "deferred_param_grads", "distribute_tensor", "fallback", "init_mesh", "knn", "radius", "reduce_partials",
    "register_aten", "register_function", "ReplicaMismatchError", "scatter_tensor", "sync_module",
]
__version__ = "0.1.0"
