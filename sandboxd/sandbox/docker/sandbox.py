"""One Docker sandbox as the pool sees it: its shim channel over two connections.

- the shim protocol (``sandbox.transport: socket``, the default): the shim's one
  connection to the sandbox's socket (sockets.py). A call then goes daemon ↔ node
  directly, not through dockerd and containerd-shim (docs/performance.md). With
  ``transport: attach`` (a remote engine) the protocol runs over the container's
  stdin/stdout instead.
- docker attach (attach.py): stream 2 stderr = tool output; stream 1 stdout = the
  protocol in attach mode; its end is how the daemon learns that the container exited.
"""

from __future__ import annotations

import asyncio
from typing import Any, Awaitable, Callable

from sandboxd.errors import SandboxFailed
from sandboxd.sandbox.docker.attach import STDOUT, Frames, set_reading
from sandboxd.sandbox.docker.exits import exit_message
from sandboxd.sandbox.docker.sockets import SandboxSockets
from sandboxd.sandbox.shim import ShimSandbox

EXIT_WAIT_S = 5.0  # how long a sandbox whose shim hung up may take to exit


class _ShimSocketProtocol(asyncio.Protocol):
    """The shim protocol over the sandbox's socket."""

    def __init__(self, sandbox: DockerSandbox) -> None:
        self._sandbox = sandbox

    def data_received(self, data: bytes) -> None:
        self._sandbox.channel.feed(data)

    def connection_lost(self, exc: Exception | None) -> None:
        self._sandbox.transport_closed()


class _AttachProtocol(asyncio.Protocol):
    """Demultiplexes the attach stream: stderr to the tail, stdout to the shim channel.

    In socket mode the shim closes the fds that pointed to stdout once it has connected,
    and whatever still arrives there (a tool writing to init's stdout) is tool output.
    Before the connection, stdout is an older image's shim saying ready, which the
    protocol check then refuses with a clear message.
    """

    def __init__(self, sandbox: DockerSandbox) -> None:
        self._sandbox = sandbox
        self._frames = Frames()

    def data_received(self, data: bytes) -> None:
        for stream, payload in self._frames.feed(data):
            if stream == STDOUT and self._sandbox.shim_transport is None:
                self._sandbox.channel.feed(payload)
            else:
                self._sandbox.stderr_data(payload)

    def connection_lost(self, exc: Exception | None) -> None:
        self._sandbox.attach_ended.set()
        self._sandbox.transport_closed()


class DockerSandbox(ShimSandbox):
    def __init__(self, container_id: str, user: str, max_line_bytes: int, *,
                 exit_state: Callable[[], Awaitable[dict[str, Any]]], memory: str) -> None:
        super().__init__(container_id[:12], user, max_line_bytes)
        self.container_id = container_id
        self._exit_state = exit_state  # the engine's record of why it ended (exits.exit_state)
        self._memory = memory  # its limit, for the out-of-memory message
        self.transport: asyncio.Transport | None = None  # the attach stream
        self.shim_transport: asyncio.Transport | None = None  # the shim's socket (socket mode)
        self.attach: Any = None
        self.attach_ended = asyncio.Event()  # the container's output ended: it exited
        self.sockets: SandboxSockets | None = None  # its socket directory, kept while egress is served

    async def connect_attach(self, attach: Any, raw: Any) -> None:
        """Read the container's attach stream (``attach``: the SDK's wrapper, ``raw`` its socket)."""
        self.attach = attach  # the SDK's socket wrapper closes the fd when collected
        self.transport, _ = await asyncio.get_running_loop().create_connection(lambda: _AttachProtocol(self), sock=raw)

    async def connect_shim(self, sockets: SandboxSockets) -> None:
        """Wait for the shim's one connection, or for the sandbox to end first."""
        accept = asyncio.ensure_future(sockets.accept(self.container_id))
        try:
            either: set[asyncio.Future[Any]] = {accept, self.channel.ready}
            await asyncio.wait(either, return_when=asyncio.FIRST_COMPLETED)
        finally:
            if not accept.done():
                accept.cancel()
        if not accept.done() or accept.cancelled():
            # Exited before connecting (raises its reason), or an older image said ready
            # on stdout (the protocol check refuses it).
            await self.channel.ready
            return
        conn = accept.result()
        loop = asyncio.get_running_loop()
        self.shim_transport, _ = await loop.create_connection(lambda: _ShimSocketProtocol(self), sock=conn)

    def close_egress(self) -> None:
        """End the sandbox's way out and remove its socket directory."""
        if self.sockets is not None:
            self.sockets.remove()
            self.sockets = None

    def _write(self, data: bytes) -> None:
        transport = self.shim_transport or self.transport
        if transport is not None and not transport.is_closing():
            transport.write(data)

    def _reading(self, *, protocol: bool, output: bool) -> None:
        # A paused transport sees no EOF, but destroy closes it regardless, and over the
        # socket transport the attach stream (paused only while its bucket refills) still
        # reports the container's exit.
        if self.shim_transport is not None:
            set_reading(self.shim_transport, protocol)
            set_reading(self.transport, output)
        else:  # attach: one stream carries both
            set_reading(self.transport, protocol and output)

    def close_transports(self) -> None:
        """Close the shim's socket and really close the attach connection.

        For attach, asyncio closing its socket is not enough: the SDK's wrapper holds a
        second reference, so the fd stays open; Docker keeps copying the container's
        output into it, and with nobody reading, `docker rm -f` hangs behind the full
        pipe (a tool flooding its protocol stream showed it).
        """
        if self.shim_transport is not None:
            self.shim_transport.close()
        if self.transport is not None:
            self.transport.close()
        if self.attach is not None:
            attach, self.attach = self.attach, None
            try:
                attach.close()
            except OSError:
                pass

    async def exit_reason(self) -> SandboxFailed:
        # The shim's socket closes the moment node dies; the container's exit (and the
        # engine's record of why: OOM, exit code) follows. Wait for it, briefly.
        try:
            await asyncio.wait_for(self.attach_ended.wait(), EXIT_WAIT_S)
        except TimeoutError:
            pass
        try:
            state = await self._exit_state()
        except Exception:
            state = {}
        return SandboxFailed(exit_message(state, self._memory, "\n".join(self.stderr_tail)))
