"""Ingest and partitioning: turn raw CFD / climate files into a spatially partitioned Zarr store.

Installed as ``domainflow.preprocess``; always import it by that name, never as bare ``preprocess``.
"""
