"""domainflow: domain parallelism for scientific ML.

Split the input domain (grid rows, mesh points) of one sample across ranks; ``ShardTensor`` carries
each rank's uneven chunk and a dispatch engine adds the collectives each op needs, so an unmodified
PyTorch model gives the single-device answer.
"""

from .errors import (CollectiveError, DomainflowError, ShardingMismatchError, ShardingShapeError,
                     UnsupportedShardedOp)
from .fallback import fallback
from .mesh import init_mesh
from .placements import Partial, Placement, Replicate, Shard
from .registry import REGISTRY, register_aten, register_function
from .shard_tensor import ShardTensor, distribute_tensor, scatter_tensor
from .spec import ShardSpec
from . import comm
from . import ops as _ops  # noqa: F401  (registers the built-in handlers)

__all__ = [
    "CollectiveError", "DomainflowError", "Partial", "Placement", "REGISTRY", "Replicate", "Shard",
    "ShardSpec", "ShardTensor", "ShardingMismatchError", "ShardingShapeError", "UnsupportedShardedOp",
    "distribute_tensor", "fallback", "init_mesh", "register_aten", "register_function", "scatter_tensor",
]
__version__ = "0.1.0"
