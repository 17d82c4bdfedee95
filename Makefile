# sandboxd — everyday commands. `make help` lists them.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
LOCAL  := .sandboxd

.PHONY: help setup docker gvisor test-gvisor image swarm-images serve test typecheck test-unit test-shim test-e2e bench soak clean install uninstall shim-deps clients test-clients test-clients-router

help:
	@echo "make serve   set up, build the runner image and start the daemon (data in $(LOCAL)/data; SOCKET=PATH)"
	@echo "make test    every test: types (mypy), unit, shim (node --test) and end-to-end against real Docker"
	@echo "make typecheck  mypy over sandboxd/ (part of make test)"
	@echo "make bench   benchmarks, side by side with the floors (BENCH_ARGS=--quick for a short run; BENCH_ARGS='--quick --only instructions': instructions per warm call, needs valgrind)"
	@echo "make image   build the runner image (no registry needed)"
	@echo "make swarm-images  the daemon and etcd images packaging/swarm/ deploys (docs/scale.md, On Docker Swarm)"
	@echo "make gvisor  (as root) install gVisor's runsc and register it with the engine, for sandbox.runtime: runsc"
	@echo "make test-gvisor  the end-to-end set again with every sandbox under gVisor (after make gvisor)"
	@echo "make clients install (npm ci) and build the TypeScript client and the pi extension, and the MCP hosts' clients for the tests (clients/)"
	@echo "make shim-deps  the shim's esbuild, for \`sandboxd run --backend process\` without Docker"
	@echo "make install (as root) install the daemon as a systemd service; see docs/install.md"

# Quiet when nothing changed: each step says what it does only when it does it.
$(BIN)/sandboxd: pyproject.toml
	@echo "setup: installing sandboxd and its dependencies into $(VENV) (pyproject.toml is newer)"
	@$(PYTHON) -m venv $(VENV)
	@$(BIN)/pip install -q --upgrade pip
	@# PYTHONWARNINGS: setuptools' banner about editable installs, printed at every install, is not ours to act on.
	@PYTHONWARNINGS=ignore $(BIN)/pip install -q -e '.[test]'
	@touch $@

setup: $(BIN)/sandboxd

docker:
	@bash scripts/ensure-docker.sh

# Debian's runsc, registered with the engine as sandboxd needs it; the engine reloads (SIGHUP), never restarts.
gvisor: docker
	@bash scripts/ensure-gvisor.sh

# build.sh says what it builds, and nothing when the image is up to date; its last stdout line is the tag.
image: docker
	@bash images/node/build.sh >/dev/null

# packaging/swarm/'s images: the daemon as committed (FROM the runner's base, whose layers it
# shares) and Debian's etcd. Each is rebuilt only when its inputs changed; the tags are printed.
swarm-images: setup image
	@bash images/sandboxd/build.sh
	@bash images/etcd/build.sh

# The daemon with the checkout's defaults, as every other command in the checkout has them: data in
# $(LOCAL)/data, seed/tools. SOCKET=PATH picks the socket (then `export SANDBOXD_SOCKET=PATH` in the
# shell that calls it); by default it is the service's /run/sandboxd/sandboxd.sock as root.
SOCKET ?=
serve: setup image
	@$(BIN)/sandboxd serve$(if $(SOCKET), --socket $(SOCKET))

test: setup image clients typecheck
	$(SHIM_NODE) --test images/node/shim/test/*.test.js
	$(BIN)/python -m pytest tests
	$(CLIENT_TESTS)

# mypy over sandboxd/ ([tool.mypy] in pyproject.toml); part of make test.
typecheck: setup
	$(BIN)/mypy

test-unit: setup shim-deps
	$(BIN)/python -m pytest tests/unit

# The e2e set under gVisor (E2E_SANDBOX_RUNTIME=runsc puts every test daemon's sandboxes on it): the
# kernel check, the kill, the seed tools, calls with progress, cancel, kill and timeouts, the egress
# proxy and the hostile catalogue. test_gvisor.py also runs in make test (skipped without runsc).
GVISOR_E2E := tests/e2e/test_gvisor.py tests/e2e/test_kill.py tests/e2e/test_seed_tools.py \
	tests/e2e/test_egress.py tests/e2e/test_hostile.py tests/e2e/test_daemon.py
GVISOR_DAEMON_TESTS := progress or cancel or kill or timeout or hello_round_trip or transport or email_db or env_and_mounts
test-gvisor: setup image gvisor
	E2E_SANDBOX_RUNTIME=runsc E2E_REQUIRE_GVISOR=1 $(BIN)/python -m pytest $(GVISOR_E2E) \
		-k "not test_daemon or $(GVISOR_DAEMON_TESTS)"

# The shim's tests run on the Node the image ships (images/node/runtime's lock file), not the host's.
SHIM_NODE = "$$(bash images/node/node-runtime.sh)"
test-shim:
	$(SHIM_NODE) --test images/node/shim/test/*.test.js

# clients/: @sandboxd/client, then @sandboxd/pi (which links it). npm ci runs again only when a lock file changes.
CLIENT_DIRS := clients/typescript clients/pi
clients/%/node_modules/.package-lock.json: clients/%/package-lock.json clients/%/package.json
	@echo "clients: npm ci in clients/$* (its lock file changed; clients/pi fetches pi's SDK, about 20 s the first time)"
	@cd clients/$* && npm ci --no-audit --no-fund --loglevel=error
	@touch $@

clients/typescript/dist/index.js: clients/typescript/node_modules/.package-lock.json clients/typescript/tsconfig.json $(wildcard clients/typescript/src/*.ts)
	@echo "clients: building @sandboxd/client (tsc) into clients/typescript/dist"
	@cd clients/typescript && npm run --silent build

clients/pi/dist/index.js: clients/pi/node_modules/.package-lock.json clients/pi/tsconfig.json $(wildcard clients/pi/src/*.ts) clients/typescript/dist/index.js
	@echo "clients: building @sandboxd/pi (tsc) into clients/pi/dist"
	@cd clients/pi && npm run --silent build

# clients/mcp-hosts: no build, only the MCP clients hosts use (the TypeScript SDK, pi-mcp-adapter), pinned.
clients: $(foreach dir,$(CLIENT_DIRS),$(dir)/dist/index.js) clients/mcp-hosts/node_modules/.package-lock.json

# Against a real daemon (the repo's .venv) and Docker, like test-e2e.
CLIENT_TESTS = cd clients/typescript && npm test && cd ../pi && npm test && cd ../mcp-hosts && npm test
test-clients: setup image clients
	$(CLIENT_TESTS)

# The same tests with each daemon replaced by `sandboxd router` in front of two hosts (tests/cluster/fleet.py).
test-clients-router: setup image clients
	export CLIENTS_VIA_ROUTER=1; $(CLIENT_TESTS)

# What the process backend needs when there is no Docker to build the image (docs/tool-development.md).
shim-deps:
	cd images/node/shim && { node -e 'require("esbuild")' 2>/dev/null || npm ci --omit=dev --ignore-scripts --no-audit --no-fund --loglevel=error; }

test-e2e: setup image
	$(BIN)/python -m pytest tests/e2e

bench: setup image clients
	$(BIN)/python -m bench $(BENCH_ARGS)

soak: setup image
	$(BIN)/python -m pytest tests/soak -m soak -s

clean:
	rm -rf $(VENV) $(LOCAL) build clients/*/node_modules clients/*/dist


# -- the daemon as a systemd service (docs/install.md) ---------------------------------
# A system Python: the service user must be able to run the venv's interpreter.
INSTALL_PYTHON ?= /usr/bin/python3
PREFIX         ?= /opt/sandboxd
UNIT_DIR       ?= /etc/systemd/system
SYSUSERS_DIR   ?= /etc/sysusers.d
CONFIG_DIR     ?= /etc/sandboxd
LINK_DIR       ?= /usr/local/bin

install: image
	@test "$$(id -u)" -eq 0 || { echo "make install: run it as root (sudo make install)" >&2; exit 1; }
	$(INSTALL_PYTHON) -m venv $(PREFIX)
	$(PREFIX)/bin/pip install -q .
	install -d -m 0755 $(LINK_DIR) && ln -sf $(PREFIX)/bin/sandboxd $(LINK_DIR)/sandboxd
	rm -rf $(PREFIX)/seed && mkdir -p $(PREFIX)/seed && cp -R seed/tools $(PREFIX)/seed/tools
	install -d -m 0755 $(PREFIX)/share/doc
	install -m 0644 docs/*.md $(PREFIX)/share/doc/
	install -d -m 0755 $(PREFIX)/share/prometheus  # alerting rules for the operator's Prometheus (docs/install.md, "Alerts")
	sed 's|/opt/sandboxd|$(PREFIX)|g' packaging/prometheus/sandboxd-alerts.yml > $(PREFIX)/share/prometheus/sandboxd-alerts.yml
	install -D -m 0644 packaging/sysusers.d/sandboxd.conf $(SYSUSERS_DIR)/sandboxd.conf
	if command -v systemd-sysusers >/dev/null; then systemd-sysusers $(SYSUSERS_DIR)/sandboxd.conf; \
	elif ! id sandboxd >/dev/null 2>&1; then \
	  useradd --system --user-group --home-dir /var/lib/sandboxd --shell /usr/sbin/nologin sandboxd; fi
	install -d -m 0755 $(UNIT_DIR)
	sed -e 's|/usr/bin/env sandboxd|$(PREFIX)/bin/sandboxd|' -e 's|/opt/sandboxd|$(PREFIX)|g' \
	  packaging/systemd/sandboxd.service > $(UNIT_DIR)/sandboxd.service
	install -m 0644 packaging/systemd/sandboxd.socket $(UNIT_DIR)/sandboxd.socket
	@# The disk quota helper (docs/install.md, "Disk quotas"): socket-activated, root with three capabilities.
	sed 's|/usr/bin/env python3|$(PREFIX)/bin/python|' packaging/systemd/sandboxd-quota@.service > $(UNIT_DIR)/sandboxd-quota@.service
	install -m 0644 packaging/systemd/sandboxd-quota.socket $(UNIT_DIR)/sandboxd-quota.socket
	install -d -m 0750 -g sandboxd $(CONFIG_DIR)
	test -e $(CONFIG_DIR)/config.yaml || { sed 's|/opt/sandboxd|$(PREFIX)|g' packaging/config.yaml > $(CONFIG_DIR)/config.yaml \
	  && chgrp sandboxd $(CONFIG_DIR)/config.yaml && chmod 0640 $(CONFIG_DIR)/config.yaml; }
	systemd-analyze verify $(UNIT_DIR)/sandboxd.service $(UNIT_DIR)/sandboxd.socket $(UNIT_DIR)/sandboxd-quota.socket
	if [ -d /run/systemd/system ]; then systemctl daemon-reload; fi
	@echo "installed. Next: systemctl enable --now sandboxd.socket sandboxd.service (docs/install.md)"

uninstall:
	@test "$$(id -u)" -eq 0 || { echo "make uninstall: run it as root (sudo make uninstall)" >&2; exit 1; }
	if [ -d /run/systemd/system ]; then systemctl disable --now sandboxd.service sandboxd.socket sandboxd-quota.socket || true; fi
	rm -f $(UNIT_DIR)/sandboxd.service $(UNIT_DIR)/sandboxd.socket $(UNIT_DIR)/sandboxd-quota.socket \
	  $(UNIT_DIR)/sandboxd-quota@.service $(SYSUSERS_DIR)/sandboxd.conf
	if [ "$$(readlink $(LINK_DIR)/sandboxd)" = "$(PREFIX)/bin/sandboxd" ]; then rm -f $(LINK_DIR)/sandboxd; fi
	rm -rf $(PREFIX)
	if [ -d /run/systemd/system ]; then systemctl daemon-reload; fi
	@echo "left in place: $(CONFIG_DIR), /var/lib/sandboxd (tools and user data), the runner images and the sandboxd user;"
	@echo "to remove them too: docs/install.md, \"Uninstall and purge\""
