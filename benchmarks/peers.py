"""The peer libraries the benchmarks compare against when they are installed: PhysicsNeMo's ShardTensor.

PhysicsNeMo is not a dependency of domainflow. ``make peers`` installs it, and the few packages its domain
parallel code imports, with ``--no-deps`` into ``.peers/physicsnemo`` (its declared dependencies would pull
another torch). Only the op families a benchmark compares are imported (convolution, padding,
interpolation), not PhysicsNeMo's model zoo (which needs timm and torchvision). On CPU it runs on Gloo.
"""

from __future__ import annotations

import sys
from pathlib import Path

PEERS = Path(__file__).resolve().parent.parent / ".peers"
INSTALL_HINT = "run `make peers` (installs PhysicsNeMo with --no-deps into .peers/physicsnemo)"


def physicsnemo_available() -> bool:
    """Whether PhysicsNeMo's ShardTensor can be imported (from .peers/physicsnemo or the environment)."""
    try:
        load_physicsnemo()
    except ImportError:
        return False
    return True


def load_physicsnemo():
    """Import PhysicsNeMo's ``domain_parallel`` with its convolution, padding and interpolation handlers
    registered (PhysicsNeMo registers them at import only when CUDA is present); raise ImportError naming
    ``make peers`` when it is missing."""
    path = str(PEERS / "physicsnemo")
    if (PEERS / "physicsnemo").is_dir() and path not in sys.path:
        sys.path.insert(0, path)
    try:
        import physicsnemo.domain_parallel as pdp
        from physicsnemo.domain_parallel.custom_ops import _tensor_ops, mean_wrapper, sum_wrapper  # noqa: F401
        from physicsnemo.domain_parallel.shard_utils import conv_patches, padding, unpooling_patches  # noqa: F401
    except ImportError as exc:
        raise ImportError(f"PhysicsNeMo is not importable ({exc}); {INSTALL_HINT}") from None
    return pdp
