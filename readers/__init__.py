"""Region readers: each rank reads only its own part of a partitioned Zarr store and gets ShardTensors.

Installed as ``domainflow.readers``; always import it by that name, never as bare ``readers``.
"""
