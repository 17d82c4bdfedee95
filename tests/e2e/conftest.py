"""End-to-end harness: a real `sandboxd serve` process, a real socket, real Docker.

Every daemon gets its own data path and socket (so its own instance label), runs
its sandboxes on network `none`, and is checked for leftover containers when it
stops.
"""

from __future__ import annotations

import json
import os
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Iterator

import pytest

from bench.dead_resolver import loopback_only_prefix
from sandboxd.client import Client
from sandboxd.config import RUNNER_IMAGE

REPO = Path(__file__).resolve().parents[2]
TOOL_FIXTURES = Path(__file__).resolve().parent / "tools"


def docker_client() -> Any:
    import docker

    try:
        client = docker.from_env()
        client.ping()
        return client
    except Exception as exc:  # pragma: no cover - depends on the machine
        pytest.fail(f"Docker engine not reachable ({exc}); `make test` starts it via scripts/ensure-docker.sh")


@pytest.fixture(scope="session")
def docker_api() -> Any:
    client = docker_client()
    try:
        client.images.get(RUNNER_IMAGE)
    except Exception:
        pytest.fail(f"runner image {RUNNER_IMAGE} is missing; build it with `make image`")
    return client


def write_tool(root: Path, name: str, source: str, *, inputs: str = "", version: int = 1, entry: str = "index.ts",
               description: str | None = None) -> Path:
    """Write a tool directory with a TOOL.md and an entry file."""
    tool = root / name
    tool.mkdir(parents=True, exist_ok=True)
    inputs_block = f"inputs:\n{inputs}" if inputs else ""
    (tool / "TOOL.md").write_text(
        f"---\nname: {name}\ndescription: {description or 'Test tool ' + name + '.'}\nversion: {version}\n"
        f"{inputs_block}\n---\n\n# {name}\n"
    )
    (tool / entry).write_text(source)
    return tool


# A tool that runs params.script with python3 as the sandbox uid; a non-zero exit makes it an error result.
PYTHON_SCRIPT_TOOL = """
import { spawn } from 'node:child_process';
export async function execute(_id: string, params: { script: string }) {
  const child = spawn('python3', ['-c', params.script], { stdio: ['ignore', 'pipe', 'pipe'] });
  let out = '';
  child.stdout.on('data', (d) => { out += d; });
  child.stderr.on('data', (d) => { out += d; });
  const code = await new Promise((done) => child.on('close', done));
  return { content: [{ type: 'text', text: out.trim() }], isError: code !== 0 };
}
"""


RUNTIME = os.environ.get("E2E_SANDBOX_RUNTIME", "")
GVISOR = RUNTIME == "runsc"
# A write into a read-only mount: EROFS from the host's kernel; gVisor's checks the folder's
# permissions first (the sandbox is not its owner), so the same refusal says EACCES (EPERM for chmod).
READ_ONLY_REFUSALS = ("EROFS", "EACCES", "EPERM") if GVISOR else ("EROFS",)


def gvisor_registered() -> str | None:
    """Why the engine cannot run sandboxes under gVisor as sandboxd needs it, or None."""
    import docker

    from sandboxd.sandbox.docker.runtime import runtime_problem

    return runtime_problem(docker.APIClient(version="auto").info(), "runsc", local=True)


def _loopback_only_tools() -> None:
    for tool, package in (("unshare", "util-linux"), ("ip", "iproute2")):
        if shutil.which(tool) is None:
            pytest.fail(f"`{tool}` is missing: a loopback-only daemon needs it (scripts/ci-deps.sh installs {package})")


def wait_answering(proc: subprocess.Popen[Any], socket_path: Path, timeout: float, what: str,
                   log: Callable[[], str]) -> None:
    """Until ``proc`` answers a ping on ``socket_path``; its exit or ``timeout`` fails with ``log()``."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"{what} exited with {proc.returncode}:\n{log()}")
        try:
            with Client(socket_path, timeout=5) as client:
                client.request("ping")
            return
        except Exception:
            time.sleep(0.1)
    raise AssertionError(f"{what} did not listen within {timeout} s:\n{log()}")


class Daemon:
    """``loopback_only``: the daemon runs in a network namespace of its own with nothing but a
    loopback device, so that an egress decision gone wrong fails to connect instead of sending
    a packet anywhere. Docker still works from there: the engine is reached over
    /var/run/docker.sock and the sandboxes over unix sockets, neither of which a network
    namespace touches."""

    def __init__(self, tmp: Path, *, config: str = "", env: dict[str, str] | None = None,
                 loopback_only: bool = False, nofile: tuple[int, int] | None = None,
                 binds: dict[str, Path] | None = None) -> None:
        if loopback_only:
            _loopback_only_tools()
        assert loopback_only or not binds, "binds (over /etc/resolv.conf, say) need loopback_only=True"
        self.loopback_only = loopback_only
        self.binds = binds  # a system file → the file the daemon sees there, in a mount namespace of its own
        self.nofile = nofile  # (soft, hard) RLIMIT_NOFILE to start the daemon with, as systemd's LimitNOFILE= would
        self.tmp = tmp
        self.data = tmp / "data"
        # Socket paths are limited to 108 bytes; pytest's tmp paths can be longer.
        self.socket = Path(tempfile.mkdtemp(prefix="sbd-")) / "sandboxd.sock"
        self.log_path = tmp / "daemon.log"
        self.config_path = tmp / "config.yaml"
        self.data.mkdir(parents=True, exist_ok=True)
        self.config_path.write_text(config)
        # Only what the test says: a SANDBOXD_* of the machine (SANDBOXD_BACKEND=process, say)
        # would otherwise change what every test runs against. Sandboxes get the default: no
        # network of their own, the egress proxy (which tests only ever point at 127.0.0.1).
        inherited = {k: v for k, v in os.environ.items() if not k.startswith("SANDBOXD_")}
        # tests/netguard/sitecustomize.py: the daemon may connect to loopback only, whatever its policy says.
        guard = str(Path(__file__).parent.parent / "netguard")
        pythonpath = os.pathsep.join(p for p in (guard, inherited.get("PYTHONPATH", "")) if p)
        # E2E_SANDBOX_RUNTIME=runsc: the whole run under gVisor (make test-gvisor); a test's env still wins.
        runtime = {"SANDBOXD_SANDBOX_RUNTIME": RUNTIME} if RUNTIME else {}
        self.env = {**inherited, "PYTHONPATH": pythonpath, **runtime, **(env or {})}
        self.proc: subprocess.Popen[bytes] | None = None
        shutil.copytree(TOOL_FIXTURES, self.data / "tools", dirs_exist_ok=True)

    def start(self, timeout: float = 30) -> Daemon:
        log = open(self.log_path, "ab")
        command = [sys.executable, "-m", "sandboxd", "serve", "--config", str(self.config_path),
                   "--data-path", str(self.data), "--socket", str(self.socket),
                   "--seed-tools", str(REPO / "seed" / "tools")]
        if self.loopback_only:  # exec: the daemon keeps unshare's pid, signals reach it directly
            command = [*loopback_only_prefix(self.binds), *command]
        nofile = self.nofile
        limit = None if nofile is None else (lambda: resource.setrlimit(resource.RLIMIT_NOFILE, nofile))
        self.proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=self.env, cwd=REPO,
                                     preexec_fn=limit)
        wait_answering(self.proc, self.socket, timeout, "daemon", self.log)
        return self

    def network_namespace(self) -> str:
        """The daemon's network namespace (``net:[inode]``), to compare with the test's own."""
        assert self.proc is not None
        return os.readlink(f"/proc/{self.proc.pid}/ns/net")

    def network_interfaces(self) -> set[str]:
        """The network devices the daemon's process sees (its namespace's, from /proc)."""
        assert self.proc is not None
        lines = Path(f"/proc/{self.proc.pid}/net/dev").read_text().splitlines()[2:]
        return {line.split(":")[0].strip() for line in lines}

    def client(self, timeout: float | None = 60) -> Client:
        return Client(self.socket, timeout=timeout)

    def user_dir(self, user: str) -> Path:
        return self.data / user

    def instance_label(self) -> str:
        from sandboxd.config import load_config
        from sandboxd.server.server import instance_id

        return instance_id(load_config(overrides={"socket": self.socket, "data_path": self.data}, environ={}))

    def containers(self, api: Any, **labels: str) -> list[dict[str, Any]]:
        """This daemon's containers as the engine lists them. Only the list call: a
        per-container inspect (what `api.containers.list` does) races with the daemon
        removing a sandbox and fails with 404."""
        wanted = [f"org.sandboxd.instance={self.instance_label()}"] + [f"{k}={v}" for k, v in labels.items()]
        return api.api.containers(all=True, filters={"label": wanted})

    def remove_leftovers(self, api: Any) -> None:
        """After a test: remove what the daemon left, then fail the test if it left anything."""
        leftovers = self.containers(api)
        for container in leftovers:
            api.api.remove_container(container["Id"], force=True)
        shutil.rmtree(self.socket.parent, ignore_errors=True)  # its mkdtemp folder (the shims' sockets beside it)
        assert not leftovers, f"daemon left {len(leftovers)} containers behind:\n{self.log()}"

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 40) -> int:
        assert self.proc is not None
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
                raise AssertionError(f"daemon did not stop within {timeout} s:\n{self.log()}")
        return self.proc.returncode

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")[-8000:]

    def events(self, name: str, **match: Any) -> list[dict[str, Any]]:
        """The events named ``name`` in the daemon's whole log (not log()'s tail) whose fields equal ``match``."""
        found = []
        for line in self.log_path.read_text(errors="replace").splitlines():
            try:
                record = json.loads(line)
            except ValueError:
                continue  # not a JSON line (a traceback, say)
            if isinstance(record, dict) and record.get("event") == name and all(record.get(k) == v for k, v in match.items()):
                found.append(record)
        return found


@pytest.fixture
def make_daemon(tmp_path: Path, docker_api: Any) -> Iterator[Any]:
    """Factory: make_daemon(config="pool:\\n  min_idle: 0\\n") → a started Daemon; stopped and checked after.

    ``loopback_only=True`` starts it in a network namespace with only a loopback device (Daemon)."""
    daemons: list[Daemon] = []

    def factory(config: str = "", start: bool = True, **kwargs: Any) -> Daemon:
        daemon = Daemon(tmp_path / f"d{len(daemons)}", config=config, **kwargs)
        daemons.append(daemon)
        return daemon.start() if start else daemon

    yield factory
    for daemon in daemons:
        if daemon.proc is not None:
            daemon.stop()
        daemon.remove_leftovers(docker_api)


@pytest.fixture
def daemon(make_daemon: Any) -> Daemon:
    return make_daemon()


@pytest.fixture
def stopper() -> Iterator[list[subprocess.Popen[str]]]:
    """Processes a test started beside its daemon (servers in its namespace, hostile clients), killed at its end."""
    started: list[subprocess.Popen[str]] = []
    yield started
    for proc in started:
        if proc.poll() is None:
            proc.kill()
        proc.wait()
