"""Process backend: the shim as a local `node` process. UNSANDBOXED.

For tool developers without Docker: the same shim, loader and protocol, but
the tool runs with the developer's own rights and sees the host filesystem.
The service never picks it unless configured (backend: process), and every
output that comes from it says so: `sandbox/status` has ``unsandboxed: true``,
the daemon logs a warning at start, `sandboxd run` prints a banner.

Nothing is mounted: the tool sees host paths (``PI_TOOLS_DIRS``, ``HOME`` and
its entry file are the host directories of the SandboxSpec), and
``read_only_mounts`` is ignored because entries are called by host path.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
from pathlib import Path
from typing import Any

from sandboxd.config import REPO_ROOT, SandboxConfig
from sandboxd.container import sandbox_env
from sandboxd.errors import BackendUnavailable, SandboxFailed
from sandboxd.sandbox.backend import SandboxSpec
from sandboxd.sandbox.shim import SHIM_PROTOCOL, ShimSandbox
from sandboxd.tools.discovery import Tool

SHIM_MAIN = REPO_ROOT / "images" / "node" / "shim" / "src" / "main.js"
UNSANDBOXED_NOTE = "UNSANDBOXED: the process backend runs tools as local node processes with your own rights"
MIN_NODE_MAJOR = 20  # what the shim and the runner image are built for


class ProcessSandbox(ShimSandbox):
    def __init__(self, process: asyncio.subprocess.Process, user: str, max_line_bytes: int) -> None:
        super().__init__(f"pid-{process.pid}", user, max_line_bytes)
        self.process = process
        self._pumps: list[asyncio.Task[None]] = []
        # Set while each pump may read; a pump that waits lets its pipe fill (the
        # StreamReader pauses the pipe past its limit), so the shim blocks on write.
        self._read_protocol = asyncio.Event()
        self._read_output = asyncio.Event()
        self._read_protocol.set()
        self._read_output.set()

    def start_pumps(self) -> None:
        """Read its stdout (the protocol) and stderr (tool output) from now on."""
        self._pumps = [asyncio.create_task(self.pump()), asyncio.create_task(self.pump_stderr())]

    async def kill(self) -> None:
        """Kill the shim and its whole process group, and stop reading its pipes."""
        self.drain()  # wait() below returns only once both pipes reached their ends
        try:
            os.killpg(self.process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        await self.process.wait()
        for task in self._pumps:
            task.cancel()

    def _write(self, data: bytes) -> None:
        stdin = self.process.stdin
        if stdin is not None and not stdin.is_closing():
            stdin.write(data)

    def _reading(self, *, protocol: bool, output: bool) -> None:
        for event, on in ((self._read_protocol, protocol), (self._read_output, output)):
            if on:
                event.set()
            else:
                event.clear()

    async def pump(self) -> None:
        """Feed the shim's stdout to the channel until EOF."""
        assert self.process.stdout is not None
        while True:
            await self._read_protocol.wait()
            chunk = await self.process.stdout.read(1 << 16)
            if not chunk:
                break
            self.channel.feed(chunk)
        self.transport_closed()

    async def pump_stderr(self) -> None:
        assert self.process.stderr is not None
        while True:
            await self._read_output.wait()
            chunk = await self.process.stderr.read(1 << 16)
            if not chunk:
                break
            self.stderr_data(chunk)

    async def exit_reason(self) -> SandboxFailed:
        code = await self.process.wait()
        tail = "\n".join(self.stderr_tail)
        if code == 0:
            message = "The tool's process exited during the call (exit code 0): a tool must return from execute(), not call process.exit()."
        elif code < 0:
            message = f"The tool's process was killed by signal {-code} during the call."
        else:
            message = f"The tool's process exited with code {code} during the call."
        return SandboxFailed(message + (f" Its last output:\n{tail}" if tail else ""))


class ProcessBackend:
    name = "process"
    transport = "stdio"

    def __init__(self, *, max_line_bytes: int, node: str | None = None, shim: Path = SHIM_MAIN) -> None:
        self.max_line_bytes = max_line_bytes
        self.node = node or shutil.which("node") or "node"
        self.shim = shim
        self._live: set[ProcessSandbox] = set()

    async def start(self, spec: SandboxSpec) -> ProcessSandbox:
        if not self.shim.is_file():
            raise BackendUnavailable(f"the shim is missing at {self.shim}; run `make setup` in the sandboxd checkout.")
        esbuild = self.shim.parent.parent / "node_modules" / "esbuild"
        if not esbuild.is_dir():
            raise BackendUnavailable(
                f"the shim's dependencies are not installed ({esbuild} is missing); run `make shim-deps` "
                "in the sandboxd checkout.")
        for path in (spec.tools_dir, spec.user_dir, spec.user_tools_dir):
            path.mkdir(parents=True, exist_ok=True)
        env = {
            "PATH": os.environ.get("PATH", "/usr/local/bin:/usr/bin:/bin"),
            **sandbox_env(home=str(spec.user_dir), tools_dir=str(spec.tools_dir),
                          user_tools_dir=str(spec.user_tools_dir), email_db=str(spec.email_db or "")),
            "SANDBOXD_UNSANDBOXED": "1",
        }
        try:
            process = await asyncio.create_subprocess_exec(
                self.node, str(self.shim),
                stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
                env=env, cwd=spec.user_dir,
                start_new_session=True,  # its own process group, so destroy kills the tool's children too
            )
        except OSError as exc:
            raise BackendUnavailable(f"could not run {self.node}: {exc.strerror}; install Node.js 20 or newer.") from None
        sandbox = ProcessSandbox(process, spec.user, self.max_line_bytes)
        sandbox.start_pumps()
        self._live.add(sandbox)
        try:
            ready = await sandbox.channel.ready
        except SandboxFailed:
            await self.destroy(sandbox)
            tail = " | ".join(sandbox.stderr_tail)
            raise BackendUnavailable(f"the shim exited before it was ready: {tail or 'no output'}") from None
        except BaseException:
            await self.destroy(sandbox)
            raise
        problem = _ready_problem(ready, self.node)
        if problem is not None:
            await self.destroy(sandbox)
            raise BackendUnavailable(problem)
        return sandbox

    async def destroy(self, sandbox: ProcessSandbox) -> None:
        self._live.discard(sandbox)
        await sandbox.kill()

    async def remove_orphans(self) -> int:
        return 0  # processes die with the daemon (their stdin closes)

    async def preflight(self, config: SandboxConfig | None = None) -> None:
        pass  # local processes: nothing to see or not see

    def reconfigure(self, config: SandboxConfig) -> None:
        pass  # no sandbox settings apply to local processes

    def entry_path(self, tool: Tool) -> str:
        return str(tool.entry)

    async def esbuild(self, directory: Any) -> None:
        return None  # sandboxes see the host's paths, not /officer/tools: no transpile cache

    async def close(self) -> None:
        for sandbox in list(self._live):
            await self.destroy(sandbox)


def _ready_problem(ready: dict[str, Any], node: str) -> str | None:
    """Why a shim that said ready cannot be used (wrong protocol, a Node.js too old), or None."""
    if ready.get("protocol") != SHIM_PROTOCOL:
        return f"the shim at {SHIM_MAIN} speaks protocol {ready.get('protocol')!r}, not {SHIM_PROTOCOL}; update the checkout."
    version = str(ready.get("node", ""))
    try:
        major = int(version.lstrip("v").split(".")[0])
    except ValueError:
        return None  # an odd version string is no reason to refuse
    if major < MIN_NODE_MAJOR:
        return f"{node} is Node.js {version}; tools need Node.js {MIN_NODE_MAJOR} or newer. Install a newer Node.js."
    return None
