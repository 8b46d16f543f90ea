"""Built-in sharding handlers, one module per op family; importing this package registers them."""

from . import dimwise, interpolation, losses, matmul, normalization, reductions, tensor_ops, views, windows  # noqa: F401,E501
