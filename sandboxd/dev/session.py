"""An ephemeral sandbox for `sandboxd run`: the daemon's machinery, in-process, for one tool.

The sandbox is made by the same backend classes the daemon uses (Docker: same
image, same hardening, same mounts), and calls go through the daemon's own
``Pool`` and ``CallRunner``, so timeouts, cancellation and crash handling are
the ones the service applies. What differs is only where the tool comes from:
its folder is bound read-only at ``/officer/user/tools/<folder>``, and the
user data directory is a scratch directory unless ``--user`` names one.

Asked for by name (``--backend process``), never as a fallback, the process backend
runs the same shim as a local ``node`` process. That is UNSANDBOXED, and everything
that reports on it says so.
"""

from __future__ import annotations

import asyncio
import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Literal

from sandboxd.config import Config, PoolConfig, SandboxConfig
from sandboxd.container import CONTAINER_USER_TOOLS
from sandboxd.egress.proxy import EgressProxy
from sandboxd.errors import BackendUnavailable
from sandboxd.sandbox.backend import Backend, Sandbox, SandboxSpec
from sandboxd.sandbox.factory import make_backend, user_sandbox_spec
from sandboxd.sandbox.pool import Pool
from sandboxd.server.calls import CallContext, CallParams, CallRunner
from sandboxd.storage.quota import Storage
from sandboxd.tools.discovery import Tool
from sandboxd.tools.esbuild import Esbuild
from sandboxd.users import global_tools_dir

BackendName = Literal["docker", "process"]

# Containers of `sandboxd run` carry this instance label: a run that was killed leaves at most
# a stopped container, which the next run removes.
DEV_INSTANCE = "sandboxd-run"
# Whose sandbox it is without --user (the pool and the logs need a well-formed user).
DEV_USER = "developer@localhost"
KILL_MESSAGE = "The call was cancelled with Ctrl-C, then killed with a second Ctrl-C; its sandbox was stopped."


@dataclass(frozen=True)
class BackendChoice:
    backend: Backend
    reason: str  # why this one: shown next to the UNSANDBOXED label

    @property
    def unsandboxed(self) -> bool:
        return self.backend.name == "process"


def requested_backend(flag: str | None, config: Config) -> BackendName:
    """--backend, else a configured ``backend`` (file or SANDBOXD_BACKEND), else docker."""
    if flag is not None:
        return flag  # type: ignore[return-value]
    if "backend" in config.model_fields_set:
        if config.backend == "fake":
            raise BackendUnavailable("backend 'fake' is for sandboxd's own tests; use --backend docker or process.")
        return config.backend
    return "docker"


def choose_backend(requested: BackendName, config: Config) -> BackendChoice:
    """The backend asked for; raises BackendUnavailable when Docker is asked for and not usable.

    Never falls back to the process backend: running a tool unsandboxed is the
    developer's explicit choice, not what a stopped Docker engine decides.
    """
    if requested == "docker":
        docker_backend, problem = _usable_docker(config)
        if docker_backend is None:
            raise BackendUnavailable(f"{problem}; start Docker and run `make image`, or pass --backend process "
                                     "to run the tool UNSANDBOXED, as a local node process with your rights.")
        return BackendChoice(docker_backend, "Docker")
    return BackendChoice(make_backend(config, "process", instance=DEV_INSTANCE), "the process backend was asked for")


def _usable_docker(config: Config) -> tuple[Backend | None, str]:
    """The Docker backend if the engine answers and has the runner image, else why not."""
    from sandboxd.sandbox.docker import DockerBackend

    backend = make_backend(config, "docker", instance=DEV_INSTANCE)
    assert isinstance(backend, DockerBackend)
    problem = backend.unusable()
    if problem is not None:
        return None, problem
    backend.remove_stopped()  # what a killed run left; a running one belongs to another run
    return backend, "Docker"


def dev_spec(config: Config, tool_dir: Path, scratch: Path, user: str | None, *, mount_tool: bool,
             provision: Callable[[str], None] | None = None) -> SandboxSpec:
    """Mounts as the daemon makes them, with the one tool as the user's only tool.

    The scratch directory holds the user tools root (and, without ``user``, the user's
    data). With ``mount_tool`` it also holds the empty mount point of the tool's folder:
    Docker cannot create it inside the read-only tools root. ``provision`` makes a user's
    folders under their quota first, as the daemon does (``user_storage``).
    """
    tools_root = scratch / "tools"
    tools_root.mkdir(parents=True, exist_ok=True)
    if mount_tool:
        (tools_root / tool_dir.name).mkdir(exist_ok=True)
    mounts = ((tool_dir, f"{CONTAINER_USER_TOOLS}/{tool_dir.name}"),) if mount_tool else ()
    if user is not None:
        return dataclasses.replace(user_sandbox_spec(config, user, provision=provision), user_tools_dir=tools_root,
                                   read_only_mounts=mounts)
    return SandboxSpec(user=DEV_USER, tools_dir=global_tools_dir(config.data_path), user_dir=scratch,
                       user_tools_dir=tools_root, email_db=None, read_only_mounts=mounts)


def user_storage(config: Config) -> Storage:
    """The daemon's quota enforcement, for `run --user`: under hard enforcement the user's folders are
    made (or converted) as quota subvolumes before the sandbox mounts them, never as plain folders.
    ConfigError, naming the fix, where ``hard`` cannot be had (not root and no helper, say)."""
    storage = Storage(config)
    try:
        storage.resolve()
    except BaseException:
        storage.close()
        raise
    return storage


class _StreamingBackend:
    """The chosen backend, with every sandbox's output lines passed to ``on_line`` as they arrive."""

    def __init__(self, inner: Backend, on_line: Callable[[str], None]) -> None:
        self._inner = inner
        self._on_line = on_line
        self.name = inner.name

    @property
    def transport(self) -> str:
        return self._inner.transport

    async def start(self, spec: SandboxSpec) -> Sandbox:
        sandbox = await self._inner.start(spec)
        sandbox.on_output(self._on_line)
        return sandbox

    def reconfigure(self, config: SandboxConfig) -> None:
        self._inner.reconfigure(config)

    async def destroy(self, sandbox: Sandbox) -> None:
        await self._inner.destroy(sandbox)

    async def remove_orphans(self) -> int:
        return 0  # the sandboxes of other runs are theirs

    async def preflight(self, config: SandboxConfig | None = None) -> None:
        await self._inner.preflight(config)

    def entry_path(self, tool: Tool) -> str:
        return self._inner.entry_path(tool)

    async def esbuild(self, directory: Path) -> Esbuild | None:
        return None  # a run transpiles its one tool in its sandbox: no cache to fill

    async def close(self) -> None:
        await self._inner.close()


class DevSession:
    """One warm sandbox and the calls made in it, one at a time."""

    def __init__(self, config: Config, choice: BackendChoice, spec: SandboxSpec, *, keep_warm: bool,
                 on_tool_output: Callable[[str], None]) -> None:
        self.config = config
        self.choice = choice
        # The daemon's egress policy applies in development too: a tool sees the network it will get.
        self.egress = EgressProxy(config.egress)
        self.spec = spec = dataclasses.replace(spec, egress=self.egress)
        self.backend = _StreamingBackend(choice.backend, on_tool_output)
        pool_config = PoolConfig(
            max_per_user=1, max_total=1,
            # --watch: a sandbox that crashed or was killed is replaced at once, ready for the next save.
            min_idle=1 if keep_warm else 0,
            idle_ttl_s=365 * 24 * 3600.0,  # the session decides when the sandbox goes
            max_calls_per_sandbox=config.pool.max_calls_per_sandbox,
            start_timeout_ms=config.pool.start_timeout_ms,
            acquire_timeout_ms=config.pool.start_timeout_ms + 5_000,  # a start fails first, with its reason
            shutdown_grace_s=0.0,
        )
        self.pool = Pool(self.backend, pool_config, lambda _user: spec)
        self.runner = CallRunner(config, self.pool, self.backend)
        self.calls = 0
        self._current: CallContext | None = None

    async def call(self, tool: Tool, arguments: dict[str, Any], timeout_s: float,
                   on_progress: Callable[[list[Any]], None]) -> dict[str, Any]:
        """Run execute() once; the result object is the daemon's (content, isError, status, durationMs)."""
        self.calls += 1
        params = CallParams(self.spec.user, tool, arguments, f"run_{self.calls}", {}, timeout_s)
        ctx = self._current = CallContext()
        try:
            # In a task of its own: a cancel while it waits for the sandbox cancels that task, not ours.
            return await asyncio.ensure_future(self.runner.run(params, ctx, on_progress))
        finally:
            self._current = None

    def interrupt(self) -> Literal["cancel", "kill", "wait"] | None:
        """Ctrl-C: the first fires the tool's AbortSignal, the second kills the sandbox.

        Returns what it did: None when no call runs, "wait" when the call is already ending.
        """
        ctx = self._current
        if ctx is None:
            return None
        if ctx.cancel_reason is None:
            ctx.cancel("cancelled with Ctrl-C")
            return "cancel"
        return "kill" if ctx.kill(KILL_MESSAGE) else "wait"

    async def close(self) -> None:
        await self.pool.close(grace=0.0)
        await self.backend.close()
        self.egress.close()
