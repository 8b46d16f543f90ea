"""The ``domainflow`` command (``cli.py``: it assembles the subcommands ``domainflow.preprocess.cli`` and
``domainflow.train.cli`` own) and the self-check. The top of the import graph: the only core folder that may
import ``domainflow.train`` and ``domainflow.preprocess``."""
