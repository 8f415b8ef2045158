# make lint: ruff on the Python sources, mypy on the typed packages (the `files` of
# [tool.mypy] in pyproject.toml), ansible-lint (production profile, see .ansible-lint) on
# ansible/. Included by the Makefile (`-include mk/*.mk`), which defines BIN and STAMP.
RUFF_PATHS := $(wildcard moe_service pipeline tests bench tools)

.PHONY: lint lint-python lint-types lint-ansible

lint: lint-python lint-types lint-ansible

lint-python: $(STAMP)
	$(BIN)/ruff check $(RUFF_PATHS)

# ~50 s cold on 2 cores, ~5 s with its cache (.mypy_cache/).
lint-types: $(STAMP)
	$(BIN)/mypy

# ansible-lint runs ansible-playbook --syntax-check itself: the venv's bin must come first.
lint-ansible: $(STAMP)
	PATH="$(abspath $(BIN)):$$PATH" $(BIN)/ansible-lint ansible/
