"""Models for the reference jobs: plain PyTorch modules (domain parallelism comes from the inputs)."""

from .meshgraphnet import MeshGraphNet
from .transolver import PhysicsAttention, Transolver, TransolverBlock
from .unet import UNet

__all__ = ["MeshGraphNet", "PhysicsAttention", "Transolver", "TransolverBlock", "UNet"]
