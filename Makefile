# specmesh: `make run PROMPT="..."` and `make test` work on a fresh machine; both run `make setup` first.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
PROMPT ?= Write a Python function that checks whether a number is prime.
ARGS   ?=
# Extras installed with the project: test by default; `make setup EXTRAS=test,llamacpp` adds the llama.cpp engine
# (llama-cpp-python, built from source). The last choice sticks: later `make` calls keep it.
EXTRAS ?= $(shell cat $(VENV)/.extras 2>/dev/null || echo test)

.PHONY: setup run test test-fast models proto clean

setup: $(VENV)/.installed models

# Re-install only when the project's dependencies change. torch first, pinned: it is taken from local disk as a CPU
# build; an unpinned resolve would download a multi-GB CUDA build.
$(VENV)/.installed: pyproject.toml $(VENV)/.extras-$(EXTRAS)
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --disable-pip-version-check "torch==2.13.0"
	@case ",$(EXTRAS)," in *,llamacpp,*) $(PY) -c "import llama_cpp" 2>/dev/null || echo "make setup: building llama-cpp-python from source (first time on this machine: about 10 minutes; pip caches the wheel)";; esac
	$(PY) -m pip install -q --disable-pip-version-check -e ".[$(EXTRAS)]"
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
test-fast: $(VENV)/.installed
	$(PY) -m pytest -q -m "not real_models"

proto: $(VENV)/.installed
	$(PY) scripts/gen_proto.py

clean:
	rm -rf $(VENV) build *.egg-info
