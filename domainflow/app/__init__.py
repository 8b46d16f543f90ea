"""Entry points: the ``domainflow`` command, the launcher and the self-check. The only core folder that may
import ``domainflow.train`` and ``domainflow.preprocess``."""
