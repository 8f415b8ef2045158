# make lint: ruff on the Python sources, ansible-lint (production profile, see .ansible-lint)
# on ansible/. Included by the Makefile (`-include mk/*.mk`), which defines BIN and STAMP.
RUFF_PATHS := $(wildcard moe_service pipeline tests bench tools)

.PHONY: lint lint-python lint-ansible

lint: lint-python lint-ansible

lint-python: $(STAMP)
	$(BIN)/ruff check $(RUFF_PATHS)

# ansible-lint runs ansible-playbook --syntax-check itself: the venv's bin must come first.
lint-ansible: $(STAMP)
	PATH="$(abspath $(BIN)):$$PATH" $(BIN)/ansible-lint ansible/
