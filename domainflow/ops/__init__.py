"""Built-in sharding handlers, one module per op family; importing this package registers them."""

from . import (along_sharded, attention, dimwise, indexing, interpolation, losses, matmul,  # noqa: F401
               normalization, reductions, tensor_ops, views, windows)
