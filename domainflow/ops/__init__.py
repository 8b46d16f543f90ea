"""Built-in sharding handlers, one module per op family; importing this package registers them."""

from . import (along_sharded, dimwise, interpolation, losses, matmul, normalization, reductions,  # noqa: F401
               tensor_ops, views, windows)
