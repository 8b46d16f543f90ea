"""Models for the reference jobs: plain PyTorch modules (domain parallelism comes from the inputs)."""

from .transolver import PhysicsAttention, Transolver, TransolverBlock
from .unet import UNet

__all__ = ["PhysicsAttention", "Transolver", "TransolverBlock", "UNet"]
