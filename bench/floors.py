"""The floors and the alternatives, measured on this machine in the same run.

- a warm round trip over a raw docker attach to a bare container running a plain
  JSON echo in Node (bench/echo.js) under the same hardening flags as a sandbox:
  the least a containerised call can cost;
- docker create → attach → start → first reply: the least a cold call can cost;
- `docker run --rm` per call, and spawning `node` per call: what one would do
  without a warm pool.
"""

from __future__ import annotations

import os
import secrets
import shutil
import subprocess
import time
from pathlib import Path
from typing import Any, Callable

from docker.types import LogConfig, Mount, Ulimit

from bench.stats import summarize
from bench.wire import AttachLines, attach
from sandboxd.config import SandboxConfig
from sandboxd.sandbox.docker.spec import sandbox_user

ECHO_JS = (Path(__file__).resolve().parent / "echo.js").read_text()
LABEL = "org.sandboxd.bench"
# The hello tool's request and the reply the echo sends back have the same shape as the shim's.
CALL_LINE = b'{"jsonrpc":"2.0","id":%d,"method":"call","params":{"toolCallId":"call_%d","entry":"/officer/tools/hello/index.ts","arguments":{"name":"World"},"env":{},"maxResultBytes":1048576}}\n'


class FloorContainers:
    """Bare echo containers with the sandbox's hardening flags, removed by ``close``."""

    def __init__(self, api: Any, config: SandboxConfig, run_id: str) -> None:
        self.api = api
        self.config = config
        self.run_id = run_id
        self.ids: list[str] = []

    def create(self, *, shim_tools: Path | None = None) -> str:
        """Create (not start) one echo container, flags as DockerBackend._create sets them.

        With ``shim_tools``, the container runs the image's own entrypoint (the shim) with
        that directory mounted read-only at /officer/tools, as a sandbox has it.
        """
        cfg = self.config
        mounts = [Mount("/officer/tools", str(shim_tools), type="bind", read_only=True)] if shim_tools else None
        host_config = self.api.create_host_config(
            mounts=mounts,
            tmpfs={"/tmp": f"rw,nosuid,nodev,size={cfg.tmp_size}", "/officer/data": "rw,nosuid,nodev,size=16m"},
            read_only=cfg.read_only_root,
            cap_drop=["ALL"],
            security_opt=["no-new-privileges"] if cfg.no_new_privileges else None,
            mem_limit=cfg.memory,
            memswap_limit=cfg.memory,
            nano_cpus=int(cfg.cpus * 1e9),
            pids_limit=cfg.pids_limit,
            ulimits=[Ulimit(name="core", soft=0, hard=0), Ulimit(name="nofile", soft=4096, hard=4096)],
            init=cfg.init,
            network_mode="none",
            runtime=cfg.runtime,
            ipc_mode="private",
            log_config=LogConfig(type=LogConfig.types.NONE),
        )
        container = self.api.create_container(
            cfg.image,
            name=f"sandboxd-bench-{secrets.token_hex(4)}",
            entrypoint=None if shim_tools else ["node", "-e", ECHO_JS],
            environment={"PI_TOOLS_DIRS": "/officer/tools"} if shim_tools else None,
            stdin_open=True,
            detach=True,  # StdinOnce off: the floors attach to one container several times
            tty=False,
            user=sandbox_user(cfg.user),
            labels={LABEL: self.run_id},
            host_config=host_config,
            network_disabled=True,
        )
        self.ids.append(container["Id"])
        return container["Id"]

    def started(self, count: int) -> list[str]:
        ids = [self.create() for _ in range(count)]
        for cid in ids:
            self.api.start(cid)
        return ids

    def remove(self, cid: str) -> None:
        try:
            self.api.remove_container(cid, force=True, v=True)
        except Exception:
            pass
        if cid in self.ids:
            self.ids.remove(cid)

    def close(self) -> None:
        for cid in list(self.ids):
            self.remove(cid)


def attach_round_trips(lines: AttachLines, count: int) -> list[float]:
    """Sequential request/reply round trips over one attach stream."""
    samples = []
    clock = time.perf_counter
    for i in range(count):
        request = CALL_LINE % (i, i)
        started = clock()
        lines.send(request)
        lines.read_line()
        samples.append(clock() - started)
    return samples


def attach_floor(floors: FloorContainers, count: int, warmup: int) -> tuple[dict[str, Any], str]:
    """Warm raw-attach round trip; returns the summary and the (still running) container's id."""
    (cid,) = floors.started(1)
    lines = attach(floors.api, cid)
    try:
        attach_round_trips(lines, warmup)
        summary = summarize(attach_round_trips(lines, count))
    finally:
        lines.close()
    return summary, cid


class EchoSession:
    """A started echo container and its attach stream, for floor samples taken between the daemon's."""

    def __init__(self, floors: FloorContainers) -> None:
        self._floors = floors
        (self.cid,) = floors.started(1)
        self._lines = attach(floors.api, self.cid)

    def round_trips(self, count: int) -> list[float]:
        return attach_round_trips(self._lines, count)

    def create_to_reply(self) -> float:
        """One create → attach → start → first reply of a fresh echo container, in seconds."""
        return create_to_first_reply_samples(self._floors, 1)[0]

    def close(self) -> None:
        self._lines.close()
        self._floors.remove(self.cid)


def shim_round_trip(floors: FloorContainers, tools: Path, count: int, warmup: int) -> dict[str, Any]:
    """hello over a raw attach to the runner image's own shim: the sandbox without the daemon."""
    cid = floors.create(shim_tools=tools)
    lines = attach(floors.api, cid)
    try:
        floors.api.start(cid)
        if b'"method":"ready"' not in lines.read_line():
            raise RuntimeError("the shim did not say ready first")
        attach_round_trips(lines, warmup)
        return summarize(attach_round_trips(lines, count))
    finally:
        lines.close()
        floors.remove(cid)


def attach_after_pause(floors: FloorContainers, cid: str, samples: int, pause_s: float) -> dict[str, Any]:
    """The first round trip after ``pause_s`` of quiet: what a returning user's call is compared with."""
    lines = attach(floors.api, cid)
    times = []
    try:
        for _ in range(samples):
            time.sleep(pause_s)
            times.extend(attach_round_trips(lines, 1))
    finally:
        lines.close()
    return summarize(times)


def attach_flood(floors: FloorContainers, cid: str, count: int) -> dict[str, Any]:
    """Progress lines per second from a bare container writing ``count`` lines as fast as it can."""
    lines = attach(floors.api, cid)
    try:
        started = time.perf_counter()
        lines.send(b'{"jsonrpc":"2.0","id":1,"method":"flood","params":{"count":%d}}\n' % count)
        received = 0
        while b'"method":"progress"' in lines.read_line():
            received += 1
        elapsed = time.perf_counter() - started
    finally:
        lines.close()
    return {"count": received, "seconds": elapsed, "per_s": received / elapsed}


def create_to_first_reply(floors: FloorContainers, count: int) -> dict[str, Any]:
    """docker create → attach → start → first reply, as the daemon starts a sandbox; the remove is not timed."""
    return summarize(create_to_first_reply_samples(floors, count))


def create_to_first_reply_samples(floors: FloorContainers, count: int) -> list[float]:
    samples = []
    for i in range(count):
        started = time.perf_counter()
        cid = floors.create()
        lines = attach(floors.api, cid)
        floors.api.start(cid)
        lines.send(CALL_LINE % (i, i))
        lines.read_line()
        samples.append(time.perf_counter() - started)
        lines.close()
        floors.remove(cid)
    return samples


def _timed_runs(count: int, run: Callable[[], bytes]) -> dict[str, Any]:
    samples = []
    for _ in range(count):
        started = time.perf_counter()
        out = run()
        samples.append(time.perf_counter() - started)
        if b'"result"' not in out:
            raise RuntimeError(f"the echo did not answer: {out[:200]!r}")
    return summarize(samples)


def docker_run_per_call(config: SandboxConfig, count: int, run_id: str) -> dict[str, Any]:
    """`docker run --rm -i` with the sandbox's hardening flags, one per call, via the docker CLI."""
    docker = shutil.which("docker")
    if docker is None:
        return {"n": 0, "skipped": "the docker CLI is not installed"}
    cfg = config
    argv = [
        docker, "run", "--rm", "-i", "--label", f"{LABEL}={run_id}",
        "--read-only", "--tmpfs", f"/tmp:rw,nosuid,nodev,size={cfg.tmp_size}",
        "--cap-drop", "ALL", "--security-opt", "no-new-privileges", "--user", sandbox_user(cfg.user),
        "--memory", cfg.memory, "--memory-swap", cfg.memory, "--cpus", str(cfg.cpus),
        "--pids-limit", str(cfg.pids_limit), "--ulimit", "core=0:0", "--ulimit", "nofile=4096:4096",
        "--init", "--network", "none", "--ipc", "private", "--log-driver", "none",
        "--entrypoint", "node", cfg.image, "-e", ECHO_JS,
    ]
    request = CALL_LINE % (1, 1)
    return _timed_runs(count, lambda: subprocess.run(argv, input=request, capture_output=True, check=True).stdout)


def node_per_call(count: int) -> dict[str, Any]:
    """Spawning `node` on the host for each call (no container)."""
    node = shutil.which("node")
    if node is None:
        return {"n": 0, "skipped": "node is not installed on the host"}
    request = CALL_LINE % (1, 1)
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin")}
    return _timed_runs(count, lambda: subprocess.run([node, "-e", ECHO_JS], input=request, capture_output=True,
                                                     check=True, env=env).stdout)
