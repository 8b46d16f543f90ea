"""Built-in sharding handlers, one module per op family; importing this package registers them."""

from domainflow.ops import (along_sharded, attention, dimwise, fft, foreach, indexing, interpolation, losses,  # noqa: F401
                            matmul, neighbours, normalization, pointwise, reductions, tensor_ops, views, windows)
