# Set-up and everyday commands. Needs only Python 3.11 with venv; everything else
# (torch 2.13.0 CPU, numpy, pytest) is installed into $(VENV) by the `venv` target.

PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
PYTEST_ARGS ?=
# tests marked slow (Inductor's C++ builds of more compiled graphs) run with: make test TEST_MARKERS=
TEST_MARKERS ?= not slow
# test files run on this many pytest workers (pytest-xdist; a file's tests stay on one worker, sharing its fixtures).
# Not more than the cores: the suite is CPU-bound here (its ranks and commands); three workers on these two cores
# took 468 s against two's 436 s, run after one another
TEST_WORKERS ?= 2

.PHONY: venv test demo bench peers clean distclean

# Internal: create the venv and install the project into it (editable).
# The stamp makes a re-run a no-op until pyproject.toml or this Makefile change.
venv: $(VENV)/.stamp

$(PY):
	$(PYTHON) -m venv $(VENV)

# Real models the model-zoo tests run (tests/models/test_model_zoo.py) whose declared dependencies drag in far more
# than they import; installed with --no-deps, what they import at run time is in the `test` extra (tensorly,
# tensorly-torch, opt-einsum, scipy through tensorly).
MODEL_PACKAGES := neuraloperator==2.0.0

# what `make venv` imports once to write their bytecode (see the venv target), in two processes side by side: torch
# and the project, and the libraries around them (about 30 s in one process here)
WARM_TORCH := torch torch.distributed torch.distributed.tensor torch.distributed.checkpoint torch.distributed.run \
	torch._dynamo torch._inductor.compile_fx \
	domainflow domainflow.dispatch.engine domainflow.ops domainflow.app.cli domainflow.train.loop \
	domainflow.train.predict domainflow.train.forecast domainflow.readers domainflow.preprocess.ingest_mesh \
	domainflow.preprocess.ingest_grid
WARM_LIBRARIES := numpy zarr dask dask.distributed xarray netCDF4 cfgrib pyvista vtk matplotlib.pyplot tqdm yaml \
	pytest xdist monai.networks.nets neuralop tensorboard mlflow
WARM = env -u PYTHONDONTWRITEBYTECODE $(PY) -c "exec('import importlib\nfor m in \'$(1)\'.split():\n try: importlib.import_module(m)\n except Exception: pass')" >/dev/null 2>&1 || true

PKG_INITS := domainflow/__init__.py readers/__init__.py preprocess/__init__.py train/__init__.py

$(VENV)/.stamp: pyproject.toml Makefile | $(PY)
	@# The editable finder freezes at install time: a package folder installed without its
	@# __init__.py becomes a namespace package there for good, so refuse to install then.
	@for f in $(PKG_INITS); do [ -f "$$f" ] || { echo "error: $$f is missing; not installing" >&2; exit 1; }; done
	@# torch with an exact pin: a CPU wheel of exactly 2.13.0 lies on this machine's disk (pip's configured
	@# find-links); any looser spec may pull a multi-GB CUDA build. pip only finds that wheel (pip download copies it,
	@# 1 s); uv installs it with the project and its test extra (about 140 packages) in one resolution, in a third
	@# of pip's time here. setuptools/wheel: build backend for --no-build-isolation and for the wheel test.
	$(PIP) install --no-compile 'setuptools>=68' wheel uv
	rm -rf $(VENV)/wheels && $(PIP) download --no-deps torch==2.13.0 -d $(VENV)/wheels
	echo "torch==2.13.0" > $(VENV)/torch-pin.txt
	@# pip where uv fails. No bytecode compiled: a module is compiled when first imported (below), not the
	@# thousands no test imports.
	$(VENV)/bin/uv pip install --python $(PY) --constraint $(VENV)/torch-pin.txt --no-build-isolation \
		$(VENV)/wheels/torch-*.whl -e '.[test]' \
		|| $(PIP) install --no-compile --no-build-isolation torch==2.13.0 -e '.[test]'
	rm -rf $(VENV)/wheels
	@# --no-deps: neuraloperator declares wandb, h5py, configmypy, zencfg... that it does not import (tests/models/)
	$(PIP) install --no-compile --no-deps $(MODEL_PACKAGES)
	@# Bytecode of what the commands and the tests import, written once here: where PYTHONDONTWRITEBYTECODE is
	@# set (as on this machine) no process would write it, and every fresh interpreter would compile torch's
	@# and the project's modules from source again (import torch: 3.4 s instead of 2.0 s here).
	($(call WARM,$(WARM_TORCH))) & ($(call WARM,$(WARM_LIBRARIES))); wait
	touch $@

# with bytecode writing on (this machine sets PYTHONDONTWRITEBYTECODE): pytest keeps its assertion-rewritten test
# modules in __pycache__ instead of rewriting all of them in every worker (collection 20 s -> 10 s per worker), and
# the ranks, fork servers and commands the tests start reuse the bytecode of what they import. Inductor compiles
# its kernels in the rank's own process (not a pool of compile workers, each importing torch: 5 s less CPU for the
# Inductor test here)
test: venv
	env -u PYTHONDONTWRITEBYTECODE TORCHINDUCTOR_COMPILE_THREADS=1 $(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder $(if $(TEST_MARKERS),-m "$(TEST_MARKERS)") $(PYTEST_ARGS)

demo: venv
	$(VENV)/bin/domainflow demo

bench: venv
	@set -e; for f in benchmarks/*.py; do \
		[ -e "$$f" ] || continue; \
		echo "== $$f"; \
		$(PY) "$$f"; \
	done

# Optional: PhysicsNeMo, the peer the halo benchmarks compare against, with --no-deps (its declared
# dependencies would replace torch) and only the packages its domain-parallel code imports.
PEER_PACKAGES := nvidia-physicsnemo==2.2.2 warp-lang==1.19.0 treelib==1.8.0 tensordict==0.15.3 \
	pyvers==0.2.3 termcolor==3.3.0 einops==0.8.2 jaxtyping==0.3.11 wadler-lindig==0.1.8
peers: venv
	$(PIP) install --no-deps --target .peers/physicsnemo $(PEER_PACKAGES)

clean:
	rm -rf build dist *.egg-info .pytest_cache demo_output
	find . -path ./$(VENV) -prune -o -name __pycache__ -type d -prune -exec rm -rf {} +

# Also drop the venv (the next `make` rebuilds it from the on-disk torch wheel).
distclean: clean
	rm -rf $(VENV) .peers
