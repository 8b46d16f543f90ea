"""Built-in sharding handlers, one module per op family; importing this package registers them."""

from . import dimwise, losses, matmul, reductions, tensor_ops, views, windows  # noqa: F401
