#!/usr/bin/env bash
# Make gVisor (runsc) a runtime of the local Docker engine, for `sandbox.runtime: runsc`
# (docs/install.md, "gVisor"): install Debian's runsc package when missing (as root),
# register it in /etc/docker/daemon.json with the flags sandboxd needs, merged into what the
# file already holds, and reload the engine with SIGHUP. The engine is never restarted:
# containers that run meanwhile (other people's too) go on.
#   --platform=ptrace  works everywhere, nested virtualisation or not (systrap/KVM are faster
#                      where the host has them: docs/performance.md)
#   --network=none     sandboxes have no network of their own; runsc refuses to start without
#                      it in the root network namespace
#   --host-uds=open    lets the shim and the egress proxy reach the bind-mounted unix sockets
set -euo pipefail

CONFIG=${DOCKER_DAEMON_JSON:-/etc/docker/daemon.json}
RUNSC=/usr/bin/runsc
ARGS='["--platform=ptrace", "--network=none", "--host-uds=open"]'

if [ "$(id -u)" -ne 0 ]; then
  echo "ensure-gvisor: needs root (it installs a package and edits $CONFIG); run: sudo bash scripts/ensure-gvisor.sh" >&2
  exit 1
fi

if [ ! -x "$RUNSC" ]; then
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq runsc >/dev/null
fi

mkdir -p "$(dirname "$CONFIG")"
changed=$(python3 - "$CONFIG" "$RUNSC" "$ARGS" <<'PY'
import json, os, sys
path, runsc, args = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
try:
    with open(path) as f:
        text = f.read()
except FileNotFoundError:
    text = ""
config = json.loads(text) if text.strip() else {}
wanted = {"path": runsc, "runtimeArgs": args}
if config.get("runtimes", {}).get("runsc") == wanted:
    print("no")
    sys.exit(0)
config.setdefault("runtimes", {})["runsc"] = wanted
temporary = f"{path}.sandboxd.{os.getpid()}"
with open(temporary, "w") as f:
    json.dump(config, f, indent=2)
    f.write("\n")
os.replace(temporary, path)
print("yes")
PY
)

pid=$(pgrep -xo dockerd || true)
if [ -z "$pid" ]; then
  echo "ensure-gvisor: runsc is registered in $CONFIG; no dockerd runs here to reload (start it: bash scripts/ensure-docker.sh)" >&2
  exit 0
fi
if [ "$changed" = yes ] || ! docker info --format '{{json .Runtimes}}' | grep -q '"runsc"'; then
  kill -HUP "$pid"  # reload the configuration; running containers are untouched
  for _ in $(seq 30); do
    docker info --format '{{json .Runtimes}}' 2>/dev/null | grep -q '"runsc"' && break
    sleep 0.5
  done
fi
if ! docker info --format '{{json .Runtimes}}' | grep -q '"runsc"'; then
  echo "ensure-gvisor: dockerd does not list runsc after a reload; see its log (journalctl -u docker, or /var/log/sandboxd-dockerd.log)" >&2
  exit 1
fi
echo "ensure-gvisor: runsc $("$RUNSC" --version 2>/dev/null | head -1 | awk '{print $NF}') is registered (ptrace, no network, host unix sockets)"
