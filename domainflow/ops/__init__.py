"""Built-in sharding handlers, one module per op family; importing this package registers them."""

from . import (along_sharded, attention, dimwise, interpolation, losses, matmul, normalization,  # noqa: F401
               reductions, tensor_ops, views, windows)
