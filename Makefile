# specmesh: `make run PROMPT="..."` and `make test` work on a fresh machine; both run `make setup` first.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
PROMPT ?= Write a Python function that checks whether a number is prime.
ARGS   ?=
# Extras installed with the project: test by default; `make setup EXTRAS=test,llamacpp` adds the llama.cpp engine
# (llama-cpp-python, built from source), `EXTRAS=test,ray` Ray Serve (docs/deployment.md#ray). The last choice
# sticks: later `make` calls keep it.
EXTRAS ?= $(shell cat $(VENV)/.extras 2>/dev/null || echo test)

.PHONY: setup run test test-fast models proto clean deploy-smoke ray-smoke docs-results

setup: $(VENV)/.installed $(VENV)/.ik-build models

# Re-install only when the project's dependencies change. torch first, pinned: it is taken from local disk as a CPU
# build; an unpinned resolve would download a multi-GB CUDA build.
$(VENV)/.installed: pyproject.toml $(VENV)/.extras-$(EXTRAS)
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --disable-pip-version-check "torch==2.13.0"
	@case ",$(EXTRAS)," in *,llamacpp,*) $(PY) -c "import llama_cpp" 2>/dev/null || echo "make setup: building llama-cpp-python from source (first time on this machine: about 10 minutes; pip caches the wheel)";; esac
	$(PY) -m pip install -q --disable-pip-version-check -e ".[$(EXTRAS)]"
	touch $@

# ik_llama.cpp compiled with row-invariant kernels: a one-row pass gives a multi-row pass's bits, so the exact target
# steps one row (1.4x faster; docs/engines.md#the-row-invariant-build). About 100 s on 2 cores, once per machine
# (kept in ~/.cache/specmesh/engines, copied into .venv). Where it cannot be built the engine runs the wheel's library,
# exact with two-row steps, and this says why.
$(VENV)/.ik-build: $(VENV)/.installed specmesh/runtime/ik_build.py
	$(PY) -m specmesh.runtime.ik_build || true
	touch $@

# A marker per extras set: asking for other extras re-runs the install.
$(VENV)/.extras-$(EXTRAS):
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	rm -f $(VENV)/.extras-*
	echo "$(EXTRAS)" > $(VENV)/.extras
	touch $@

# Fetch and verify the default pair (sha256-pinned); instant when already fetched.
models: $(VENV)/.installed
	$(PY) -m coordinator models pull qwen2.5-coder-0.5b-instruct qwen2.5-coder-1.5b-instruct

run: setup
	$(PY) -m coordinator generate --prompt "$(PROMPT)" $(ARGS)

test: setup
	$(PY) -m pytest -q

# Everything but the real default models: quick feedback while developing.
test-fast: $(VENV)/.installed $(VENV)/.ik-build
	$(PY) -m pytest -q -m "not real_models"

# The deployment run for real (docs/deployment.md): builds the CPU image, starts deploy/docker-compose.yml with podman
# and podman-compose, SIGKILLs a verifier container mid-generation and requires the outputs of a run without the kill.
# Needs root and podman (apt-get install podman runc debootstrap); minutes. Not part of `make test`. ARGS are passed on.
deploy-smoke: $(VENV)/.installed
	$(PY) -m pip show podman-compose >/dev/null 2>&1 || $(PY) -m pip install -q --disable-pip-version-check "podman-compose==1.6.0"
	$(PY) scripts/deploy_smoke.py $(ARGS)

# specmesh on Ray Serve, run for real (docs/deployment.md#ray): a Ray cluster of three nodes on this machine, the
# default pair, concurrent requests, a verifier's node killed mid-generation, autoscaling 1 -> 2 -> 1, the overhead
# against `coordinator serve`. Needs the ray extra (`make setup EXTRAS=test,ray`); minutes. `make test` runs a small
# version on tiny models (tests/rayserve/). ARGS are passed on.
ray-smoke: $(VENV)/.installed
	@$(PY) -c "import ray.serve" 2>/dev/null || { echo "ray-smoke: needs the ray extra: make setup EXTRAS=test,ray" >&2; exit 2; }
	$(PY) scripts/ray_smoke.py $(ARGS)

proto: $(VENV)/.installed
	$(PY) scripts/gen_proto.py

# Re-render docs/benchmarks.md's generated part (after its marker line) from every saved report in docs/results/
# (`coordinator bench ... --json docs/results/NAME.json` adds one); tests/bench/test_results_docs.py
# fails until the committed tables are this rendering.
docs-results: $(VENV)/.installed
	@grep -qxF '<!-- generated results below: do not edit by hand -->' docs/benchmarks.md || { echo "docs-results: docs/benchmarks.md has no marker line: nothing rewritten" >&2; exit 2; }
	$(PY) -m coordinator bench --from-json docs/results/*.json --markdown docs/benchmarks.md

clean:
	rm -rf $(VENV) build *.egg-info
