"""How an op on ShardTensors runs: the handler registry, the engine (``__torch_function__`` /
``__torch_dispatch__`` routing and plan caches), the toolkit handlers are written with, the gather fallback
and the deferred reduction of parameter gradients. The engine never imports the rules in ``ops/``."""
