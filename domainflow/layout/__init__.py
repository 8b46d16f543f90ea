"""Layouts without communication: placements, ``ShardSpec``, per-rank shape arithmetic, device meshes."""
