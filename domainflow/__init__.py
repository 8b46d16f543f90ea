"""domainflow: domain parallelism for scientific ML.

Split the input domain (grid rows, mesh points) of one sample across ranks; ``ShardTensor`` carries
each rank's uneven chunk and a dispatch engine adds the collectives each op needs, so an unmodified
PyTorch model gives the single-device answer.
"""

# Names load on first use (PEP 562), so that ``import domainflow.preprocess`` in an ingest worker does not
# pay for importing torch; the first access to any of them loads the engine and its built-in handlers.
_EXPORTS = {
    "CollectiveError": "errors", "CompileUnsupportedError": "errors", "DomainflowError": "errors",
    "ShardingMismatchError": "errors",
    "ShardingShapeError": "errors", "UnsupportedShardedOp": "errors", "ReplicaMismatchError": "errors",
    "init_mesh": "layout.mesh", "Partial": "layout.placements", "Placement": "layout.placements",
    "Replicate": "layout.placements", "Shard": "layout.placements", "ShardSpec": "layout.spec",
    "ShardTensor": "tensor.shard_tensor", "distribute_tensor": "tensor.shard_tensor",
    "scatter_tensor": "tensor.shard_tensor", "reduce_partials": "tensor.partials",
    "split_blocks": "tensor.blocks", "join_blocks": "tensor.blocks", "rows_per_block": "tensor.blocks",
    "blockwise": "tensor.blocks",
    "sync_module": "tensor.consistency",
    "REGISTRY": "dispatch.registry", "register_aten": "dispatch.registry", "register_function": "dispatch.registry",
    "fallback": "dispatch.fallback", "deferred_param_grads": "dispatch.param_grads",
    "checkpoint_activations": "dispatch.activation_checkpoint", "compile": "dispatch.compiled",
    "knn": "ops.neighbours", "radius": "ops.neighbours",
    # numpy-style functions opt_einsum looks for in the module a ShardTensor's class comes from (not in __all__)
    "tensordot": "tensor.array_backend", "transpose": "tensor.array_backend", "einsum": "tensor.array_backend",
}
# Folders and top-level modules reachable as attributes (``domainflow.comm``, ``domainflow.layout.shapes``).
_SUBMODULES = ("errors", "locks", "store", "launch", "layout", "comm", "tensor", "dispatch", "ops", "app")


def load_engine() -> None:
    """Import the engine and the built-in op handlers (``ops/`` registers them on import); idempotent."""
    import importlib

    engine = importlib.import_module(".dispatch.engine", __name__)
    importlib.import_module(".ops", __name__)
    importlib.import_module(".tensor.shard_tensor", __name__).install_engine(engine)


def _bind_exports():
    """Bind every exported name (called once the engine has loaded)."""
    import importlib

    for export, module in _EXPORTS.items():
        mod = importlib.import_module("." + module, __name__)
        globals()[export] = getattr(mod, export)


def __getattr__(name):
    import importlib

    if name in _EXPORTS:
        load_engine()
        _bind_exports()
        return globals()[name]
    if name in _SUBMODULES:
        return importlib.import_module("." + name, __name__)
    raise AttributeError(f"module 'domainflow' has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(_EXPORTS) | set(_SUBMODULES))


__all__ = [
    "checkpoint_activations", "CollectiveError", "CompileUnsupportedError", "DomainflowError", "Partial", "Placement",
    "REGISTRY", "Replicate", "Shard",
    "ShardSpec", "ShardTensor", "ShardingMismatchError", "ShardingShapeError", "UnsupportedShardedOp",
    "deferred_param_grads", "distribute_tensor", "fallback", "init_mesh", "knn", "radius", "reduce_partials",
    "register_aten", "register_function", "ReplicaMismatchError", "scatter_tensor", "sync_module",
]
# (``compile`` is exported but left out of __all__: ``from domainflow import *`` would shadow the builtin)
__version__ = "0.1.0"
