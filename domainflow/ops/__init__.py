"""Built-in sharding handlers, one module per op family; importing this package registers them."""

from domainflow.ops import (along_sharded, attention, diagonal, dimwise, fft, foreach, indexing, interpolation, losses,  # noqa: F401
                            matmul, neighbours, normalization, pointwise, reductions, selection, tensor_ops, views, windows)
