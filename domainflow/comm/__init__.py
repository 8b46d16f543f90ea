"""The collective layer: every byte domainflow moves between ranks goes through this package.

Functions take local tensors and a (mesh, mesh_dim) pair and work on Gloo and NCCL alike: uneven
all-gathers are padded to the largest part (Gloo has no uneven all-gather), all-to-alls move exact
byte counts. Every collective starts with a pairing round (one fixed-size all-gather of each rank's op,
dtype and sizes; small payloads inside it, larger ones on Gloo point to point meanwhile), so ranks in
different collectives all raise a CollectiveError naming each rank's op instead of Gloo aborting or mixing
bytes. Failures are re-raised as :class:`CollectiveError` naming rank, op and mesh dim, so a timed-out
collective says who was waiting for what. ``stats`` counts calls and bytes moved, for benchmarks and tests.
Rooms, each importing only those before it: ``base`` (checks, stats, naming, groups) <- ``p2p`` (numbered, tagged point-to-point exchanges) <- ``collectives`` <- ``autograd`` (the
differentiable wrappers handlers use) <- ``indexed`` (gathers by global row index); ``halo`` (neighbour
row fetches) builds on ``p2p``. Callers use this package's names: ``from domainflow import comm``.
"""

from domainflow.comm.autograd import (all_gather_autograd, all_reduce_sum_autograd, all_reduce_to_replicated,
                                      all_to_all_autograd)
from domainflow.comm.base import (STALL_WAIT_S, CommStats, _all_gather_single, collective_error, dim_ranks,
                                  group_size, mesh_device, pending_checks, refuse_compiling, refuse_unchecked_compile,
                                  set_check_runner, stats)
from domainflow.comm.collectives import (EXCHANGE_REDUCE_MAX_BYTES, FAILED_IN_COMPILED, Rider, all_gather_ints, all_gather_object,
                                         all_gather_object_mesh, all_gather_uneven, all_reduce, all_reduce_coalesced, all_to_all_dims,
                                         broadcast, check_compiled_graph, land, ride_along)
from domainflow.comm.halo import fetch, fetch_rows, halo_exchange, return_rows
from domainflow.comm.indexed import IndexPlan, gather_indexed, index_plan, route_to_owners
from domainflow.comm.p2p import begin_exchange, ring_shift, scatter_pieces, send_header

__all__ = ["CommStats", "EXCHANGE_REDUCE_MAX_BYTES", "FAILED_IN_COMPILED", "IndexPlan", "Rider", "STALL_WAIT_S", "all_gather_autograd",
           "all_gather_ints", "all_gather_object", "all_gather_object_mesh", "all_gather_uneven", "all_reduce", "all_reduce_coalesced",
           "all_reduce_sum_autograd", "all_reduce_to_replicated", "all_to_all_autograd", "all_to_all_dims",
           "begin_exchange", "broadcast", "check_compiled_graph", "dim_ranks", "fetch", "fetch_rows", "gather_indexed", "group_size",
           "halo_exchange", "index_plan", "land", "mesh_device", "pending_checks", "refuse_compiling",
           "refuse_unchecked_compile", "ride_along", "return_rows",
           "ring_shift", "route_to_owners", "scatter_pieces", "send_header", "set_check_runner", "stats"]
