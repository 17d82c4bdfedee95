"""The interface every sandbox backend implements.

A backend starts sandboxes (one shim each), destroys them, and lists the ones
this daemon owns. The pool only ever talks to this interface: Docker is one
backend, a local `node` process another, and an in-memory fake makes the pool
tests run in milliseconds.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Protocol, TypeVar

from sandboxd.container import CONTAINER_TOOLS, CONTAINER_USER_TOOLS
from sandboxd.egress.contract import Egress
from sandboxd.rules.browser_relay import RelayForCall

if TYPE_CHECKING:
    from sandboxd.config import SandboxConfig
    from sandboxd.rules.secrets import StandIns
    from sandboxd.rules.tool_network import ToolNetwork
    from sandboxd.tools.discovery import Tool
    from sandboxd.tools.esbuild import Esbuild
    from sandboxd.tools.permissions import EmailAccess

ProgressCallback = Callable[[list[Any]], None]


def container_entry_path(tool: Tool) -> str:
    """Entry path inside a sandbox that mounts the tools where docs/tools.md says."""
    root = CONTAINER_USER_TOOLS if tool.source == "user" else CONTAINER_TOOLS
    # The entry's folder and file, split off its path's string (made once per Path), not by pathlib on every call.
    # The entry is always a file of the tool's folder.
    _, folder, entry = str(tool.entry).rsplit("/", 2)
    return f"{root}/{folder}/{entry}"


@dataclass(frozen=True)
class SandboxSpec:
    """What a sandbox for one user needs: the host paths to mount."""

    user: str
    tools_dir: Path  # DATA_PATH/tools, read-only
    user_dir: Path  # DATA_PATH/<user>, read-write
    user_tools_dir: Path  # DATA_PATH/<user>/tools, read-only over user_dir
    email_db: Path | None  # its folder is mounted at /officer/data as email_access says (sandbox/mounts.py, email_dir)
    # (host path, sandbox path) pairs bound read-only on top; `sandboxd run` mounts the one tool
    # it runs this way. The daemon never sets it: clients must not choose host paths.
    read_only_mounts: tuple[tuple[Path, str], ...] = ()
    # The trusted folder (the data path) below which the paths above are opened without
    # following links (sandbox/mounts.py); None: each path is trusted up to its own folder.
    root: Path | None = None
    # The global tools transpiled on the host (tools/transpile_cache.py), mounted read-only; None: none yet.
    transpile_cache: Path | None = None
    # The proxy a sandbox's traffic leaves through (it has no network of its own); None: no
    # way out is offered (a backend that cannot mount a socket into the sandbox offers none).
    egress: Egress | None = None
    # Makes the user's folders under their disk quota before they are mounted (storage/quota.py);
    # blocking, called where the folders are made. None: plain folders.
    provision: Callable[[str], None] | None = None
    # The email database's folder: not mounted (none), read-only (read) or read-write (write), for the
    # sandbox's whole life; it serves only calls of tools with the same access (sandbox/email_access.py).
    email_access: EmailAccess = "write"


@dataclass(frozen=True)
class OutputLimits:
    """How much tool output (stderr, stdout) a sandbox may write: calls.* in docs/config.md."""

    output_rate_bytes: int = 1 << 20  # per second, refilling the bucket
    output_burst_bytes: int = 4 << 20  # the bucket's size
    idle_output_bytes: int = 4 << 20  # allowed while no call runs, per idle period


# Built per call: slots and not frozen, as a frozen dataclass's __init__ goes through setattr.
@dataclass(slots=True)
class CallRequest:
    """One execute() call, as the shim protocol carries it (docs/shim.md). Never changed once made."""

    tool_call_id: str
    entry: str  # entry file path as the sandbox sees it
    arguments: dict[str, Any]
    env: dict[str, str] = field(default_factory=dict)
    max_result_bytes: int = 1 << 20
    # The real values behind the stand-ins in ``env`` (egress.secrets): sent only as the hosts
    # whose requests the shim must let the egress proxy read.
    stand_ins: StandIns | None = None
    # Sent when the env names OFFICER_BROWSER_RELAY_PORT: where the shim listens, or why it does not.
    browser_relay: RelayForCall | None = None

    def to_params(self) -> dict[str, Any]:
        params = {
            "toolCallId": self.tool_call_id,
            "entry": self.entry,
            "arguments": self.arguments,
            "env": self.env,
            "maxResultBytes": self.max_result_bytes,
        }
        if self.stand_ins:
            params["egressSecretHosts"] = self.stand_ins.shim_hosts()
        if self.browser_relay is not None:
            params["browserRelay"] = self.browser_relay.to_param()
        return params


@dataclass(slots=True)  # built per call, like CallRequest
class CallGuard:
    """What the daemon's side of a sandbox holds one call to, beside its ``CallRequest``; never sent
    nor changed once made."""

    # The output budget from this call on (until the next one).
    output_limits: OutputLimits = OutputLimits()
    # The tool's name, for what the sandbox logs meanwhile (egress).
    tool: str = ""
    # The call's secrets: the sandbox's logged output is masked against them from now on.
    secrets: frozenset[str] = frozenset()
    # The tool's permissions.network: where the egress proxy lets this call go (None: the policy alone).
    network: ToolNetwork | None = None


class Sandbox(Protocol):
    """A started sandbox running the shim, serving one call at a time."""

    id: str
    user: str

    @property
    def alive(self) -> bool: ...

    def call(self, request: CallRequest, on_progress: ProgressCallback,
             guard: CallGuard = CallGuard()) -> asyncio.Future[dict[str, Any]]:
        """Send the call, held to ``guard``; the future resolves to the shim's result object.

        It fails with SandboxFailed if the sandbox dies first. The caller may
        fail it itself (timeout, cancel grace); late answers are then dropped.
        """
        ...

    def cancel(self, reason: str) -> None:
        """Fire the running call's AbortSignal."""
        ...

    def on_exit(self, callback: Callable[[], None]) -> None:
        """Call ``callback`` once when the sandbox dies or turns out hostile (not when destroyed by the pool)."""
        ...

    def on_output(self, callback: Callable[[str], None]) -> None:
        """Call ``callback`` with each line of tool output (stderr, stdout) as it arrives (`sandboxd run`)."""
        ...

    def pause_reading(self) -> None:
        """Stop reading the sandbox's protocol stream: the running call's client reads no more.

        The shim then blocks on its own full socket or pipe, and nothing piles up in
        the daemon. The call's deadline still runs, and destroy still works.
        """
        ...

    def resume_reading(self) -> None:
        """Undo ``pause_reading`` (the client drained, or the call ended)."""
        ...


SandboxT = TypeVar("SandboxT", bound=Sandbox)


class Backend(Protocol[SandboxT]):
    """Generic over its own sandbox type: ``destroy`` takes back what ``start`` made."""

    name: str

    @property
    def transport(self) -> str:
        """How calls reach a sandbox's shim, as `sandbox/status` reports it."""
        ...

    async def start(self, spec: SandboxSpec) -> SandboxT:
        """Start a sandbox and wait until its shim is ready. Raises BackendUnavailable."""
        ...

    def reconfigure(self, config: SandboxConfig) -> None:
        """New sandbox settings (a reload), for sandboxes started from now on."""
        ...

    async def destroy(self, sandbox: SandboxT) -> None:
        """Kill and remove the sandbox. Idempotent; never raises."""
        ...

    async def remove_orphans(self) -> int:
        """Remove sandboxes left by an earlier run of this daemon; return how many."""
        ...

    async def preflight(self, config: SandboxConfig | None = None) -> None:
        """At start-up, and at a reload before it applies: raise ConfigError when no sandbox
        could ever start as ``config`` (default: the running one) says (a rootless or remote
        Docker engine with the socket transport, a runtime the engine lacks). An unreachable
        backend is not that: it may come back."""
        ...

    def entry_path(self, tool: Tool) -> str:
        """The path of a tool's entry file as seen inside the sandbox."""
        ...

    async def esbuild(self, directory: Path) -> Esbuild | None:
        """The esbuild binary the sandboxes' shim uses, runnable on this host (copied into
        ``directory``), for the transpile cache; None when this backend takes no cache."""
        ...

    async def close(self) -> None: ...
