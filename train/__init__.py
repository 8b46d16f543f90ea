"""Training loop and models on a ("dp", "domain") mesh, consuming ShardTensors from the readers.

Installed as ``domainflow.train``; always import it by that name, never as bare ``train``.
"""
