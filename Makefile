# sandboxd — everyday commands. `make help` lists them.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
LOCAL  := .sandboxd

.PHONY: help setup docker image serve test test-unit test-shim test-e2e bench soak clean

help:
	@echo "make serve   set up, build the runner image and start the daemon (data in $(LOCAL)/)"
	@echo "make test    every test: unit, shim (node --test) and end-to-end against real Docker"
	@echo "make bench   benchmarks, side by side with the floors"
	@echo "make image   build the runner image (no registry needed)"

$(BIN)/sandboxd: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -e '.[test]'
	@touch $@

setup: $(BIN)/sandboxd

docker:
	bash scripts/ensure-docker.sh

image: docker
	bash images/node/build.sh

serve: setup image
	$(BIN)/sandboxd serve --data-path $(LOCAL)/data

test: setup image
	node --test images/node/shim/test/*.test.js
	$(BIN)/python -m pytest tests

test-unit: setup
	$(BIN)/python -m pytest tests/unit

test-shim:
	node --test images/node/shim/test/*.test.js

test-e2e: setup image
	$(BIN)/python -m pytest tests/e2e

bench: setup image
	$(BIN)/python -m bench

soak: setup image
	$(BIN)/python -m pytest tests/soak -m soak -s

clean:
	rm -rf $(VENV) $(LOCAL) build
