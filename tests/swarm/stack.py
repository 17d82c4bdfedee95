"""packaging/swarm/'s stack on the harness's three hosts: built, deployed with deploy.sh, asked.

The test reaches each host's daemon through its unix socket, which the stack binds out to the
host's /run/sandboxd (the harness gives every host a /run of its own, a folder here).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from sandboxd import __version__
from sandboxd.client import Client, RpcError
from tests.e2e.conftest import REPO
from tests.e2e.hostile_harness import wait_until
from tests.swarm.harness import Host, Swarm

STACK = "sandboxd"
LEASE_S = 5  # packaging/swarm/config.yaml's cluster.lease_s
IMAGE = f"sandboxd/sandboxd:{__version__}"  # deploy.sh's default
BUILDS = ("images/node/build.sh", "images/sandboxd/build.sh", "images/etcd/build.sh")


def build_images() -> list[str]:
    """The runner, daemon and etcd images (each script does nothing when its image is up to date)."""
    tags = []
    for script in BUILDS:
        done = subprocess.run(["bash", str(REPO / script)], capture_output=True, text=True, timeout=900)
        if done.returncode != 0:
            pytest.fail(f"{script} failed: {done.stderr[-2000:]}")
        tags.append(done.stdout.split()[-1])
    return tags


@dataclass
class Stack:
    swarm: Swarm
    deploy_s: float = 0.0
    healthy_s: float = 0.0

    def deploy(self) -> None:
        """deploy.sh as an operator runs it: labels, certificates, images onto each host, stack deploy."""
        for host in self.swarm.hosts:
            (host.root / "run" / "sandboxd").mkdir(exist_ok=True)
            (host.root / "run" / "sandboxd-router").mkdir(exist_ok=True)
        env = {**os.environ, "DOCKER_HOST": self.swarm.manager.docker_host, "SANDBOXD_PKI": str(self.swarm.root / "pki"),
               "SANDBOXD_DATA_PATH": str(self.swarm.data_path)}
        loads = [arg for host in self.swarm.hosts for arg in ("--load", host.docker_host)]
        started = time.monotonic()
        router = ["--router", self.swarm.manager.name]  # one router, on host 1: the test's one socket
        done = subprocess.run(["bash", str(REPO / "packaging/swarm/deploy.sh"), *loads, *router, *[h.name for h in self.swarm.hosts]],
                              env=env, capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, f"deploy.sh failed:\n{done.stdout}\n{done.stderr}"
        self.deploy_s = time.monotonic() - started
        wait_until(lambda: all(self.healthy(h) for h in self.swarm.hosts) and self.healthy(self.swarm.manager, "router"),
                   180, "every host's sandboxd and the router to be healthy", interval=1.0)
        self.healthy_s = time.monotonic() - started - self.deploy_s

    def diagnose(self) -> str:
        """Each task's history and each sandboxd's last log lines, for a failure's report."""
        manager = self.swarm.manager
        parts = [manager.docker("service", "ps", "--no-trunc", "--format", "{{.Name}} {{.Node}} {{.CurrentState}} {{.Error}}",
                                *(f"{STACK}_{s}" for s in ("sandboxd", "router", "etcd1", "etcd2", "etcd3")), check=False)]
        for host in self.swarm.hosts:
            if not host.alive():
                continue
            for container in host.docker("ps", "-aq", "--filter", f"label=com.docker.swarm.service.name={STACK}_sandboxd",
                                         check=False).split():
                logs = subprocess.run(["docker", "-H", host.docker_host, "logs", "--tail", "15", container],
                                      capture_output=True, text=True, timeout=60)
                parts.append(f"--- {host.name} {container}\n{logs.stdout}{logs.stderr}")
        return "\n".join(parts)

    def container(self, host: Host, service: str) -> str:
        """The id of ``service``'s running task container on ``host``, or ''."""
        found = host.docker("ps", "-q", "--filter", f"label=com.docker.swarm.service.name={STACK}_{service}", check=False)
        return found.split()[0] if found else ""

    def healthy(self, host: Host, service: str = "sandboxd") -> bool:
        container = self.container(host, service)
        return bool(container) and host.docker("inspect", "-f", "{{.State.Health.Status}}", container, check=False) == "healthy"

    def exec(self, host: Host, service: str, *command: str) -> str:
        return host.docker("exec", self.container(host, service), *command, timeout=60)

    def socket(self, host: Host | None) -> Path:
        """``host``'s daemon's socket; None: the router's (it runs on host 1)."""
        if host is None:
            return self.swarm.manager.root / "run" / "sandboxd-router" / "sandboxd.sock"
        return host.root / "run" / "sandboxd" / "sandboxd.sock"

    def data(self, host: Host) -> Path:
        """``host``'s data path as this process sees it (each host's own folder behind the shared path)."""
        return host.root / "data"

    def host(self, name: str) -> Host:
        return next(host for host in self.swarm.hosts if host.name == name)

    def install_tools(self, *names: str) -> None:
        """tests/e2e/tools' ``names`` into every host's global tools, which the daemons discover live."""
        for host in self.swarm.hosts:
            for name in names:
                shutil.copytree(REPO / "tests" / "e2e" / "tools" / name, self.data(host) / "tools" / name, dirs_exist_ok=True)

    def hello(self, host: Host | None, user: str) -> str:
        """``user``'s hello answered by ``host``'s daemon (None: through the router): the text; a refusal raises RpcError."""
        with Client(self.socket(host), timeout=60) as client:
            result = client.call_tool(user, "hello", {"name": user})
        assert result["isError"] is False, result
        return "\n".join(part["text"] for part in result["content"])

    def refusal(self, host: Host | None, user: str) -> dict[str, Any]:
        """The -32005 answer's data for ``user`` on ``host``; fails if the call was served."""
        try:
            self.hello(host, user)
        except RpcError as refused:
            assert refused.code == -32005, refused
            assert isinstance(refused.data, dict)
            return refused.data
        raise AssertionError(f"{host.name if host else 'the router'} served {user}: a refusal was expected")

    def refused_with(self, host: Host | None, user: str, reason: str) -> bool:
        try:
            return self.refusal(host, user).get("reason") == reason
        except (AssertionError, OSError):
            return False

    def nodes(self, host: Host) -> dict[str, dict[str, Any]]:
        """`sandboxd nodes list --json` as the daemon in ``host``'s task reads the directory."""
        listed = json.loads(self.exec(host, "sandboxd", "sandboxd", "nodes", "list", "--json"))
        return {node["node"]: node for node in listed["nodes"]}

    def containers(self, host: Host, service: str) -> list[str]:
        """Every task container of ``service`` on ``host``, running or exited, as `docker ps -a` lists them."""
        found = host.docker("ps", "-a", "--format", "{{.ID}} {{.Status}}",
                            "--filter", f"label=com.docker.swarm.service.name={STACK}_{service}", check=False)
        return found.splitlines()

    def served(self, host: Host) -> list[dict[str, Any]]:
        """``host``'s daemons' call_served lines, of every task container it ran: (user, epoch, start, end)."""
        lines = []
        for container in self.containers(host, "sandboxd"):
            logs = subprocess.run(["docker", "-H", host.docker_host, "logs", container.split()[0]],
                                  capture_output=True, text=True, timeout=60)
            lines += [json.loads(line) for line in (logs.stdout + logs.stderr).splitlines() if '"call_served"' in line]
        return [line for line in lines if line.get("event") == "call_served"]

    def operator(self, host: Host, *command: str) -> str:
        """A `sandboxd` command run as the operator, in a container on the stack's network on ``host``,
        with deploy.sh's operator.yaml (docs/install.md, "Drain a host")."""
        pki = self.swarm.root / "pki"
        return host.docker("run", "--rm", "--network", f"{STACK}_cluster", "-v", f"{pki}:/pki:ro", IMAGE,
                           *command, "--config", "/pki/operator.yaml", timeout=300)

    def where(self, user: str) -> str:
        """``user``'s home host, as `sandboxd users where` reads the directory."""
        found = json.loads(self.exec(self.swarm.manager, "sandboxd", "sandboxd", "users", "where", user, "--json"))
        return str(found["node"])

    def sandboxes(self, host: Host) -> int:
        """Sandbox containers on ``host``'s own engine (not the stack's tasks)."""
        names = host.docker("ps", "--format", "{{.Image}}").split()
        return sum(1 for image in names if image.startswith("sandboxd/node:"))
