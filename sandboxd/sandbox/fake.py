"""An in-memory backend: pool and server logic tested in milliseconds.

Each fake sandbox answers a call by running ``handler(request, on_progress)``
(by default an echo of the arguments). Tests steer starts and destroys with
``start_delay``, ``destroy_delay`` and ``start_error``, and kill sandboxes with
``FakeSandbox.die``.
"""

from __future__ import annotations

import asyncio
import itertools
from typing import TYPE_CHECKING, Any, Awaitable, Callable

from sandboxd.errors import BackendUnavailable, SandboxFailed
from sandboxd.sandbox.backend import CallGuard, CallRequest, ProgressCallback, SandboxSpec

if TYPE_CHECKING:
    from sandboxd.config import SandboxConfig
    from sandboxd.tools.discovery import Tool

Handler = Callable[[CallRequest, ProgressCallback, asyncio.Event], Awaitable[dict[str, Any]]]


async def echo_handler(request: CallRequest, on_progress: ProgressCallback, aborted: asyncio.Event) -> dict[str, Any]:
    return _echo(request)


def _echo(request: CallRequest) -> dict[str, Any]:
    return {"status": "ok", "content": [{"type": "text", "text": f"{request.entry} {request.arguments}"}], "isError": False}


def _answer(future: asyncio.Future[dict[str, Any]], result: dict[str, Any]) -> None:
    if not future.done():  # not failed meanwhile (killed, timed out, died)
        future.set_result(result)


class FakeSandbox:
    def __init__(self, backend: FakeBackend, sandbox_id: str, user: str) -> None:
        self.id = sandbox_id
        self.user = user
        self._backend = backend
        self._alive = True
        self._exit_callbacks: list[Callable[[], None]] = []
        self._task: asyncio.Task[Any] | None = None
        self._future: asyncio.Future[dict[str, Any]] | None = None
        # Its backend starts it on the loop it serves; looked up once (a getpid() per lookup in Python 3.11).
        self._loop = asyncio.get_running_loop()
        self.aborted = asyncio.Event()
        # The latest call and what it was held to; not every call: a long bench run makes millions.
        self.last_call: tuple[CallRequest, CallGuard] | None = None
        self.cancel_reasons: list[str] = []
        self.reading_paused = False  # what pause_reading/resume_reading last said

    @property
    def alive(self) -> bool:
        return self._alive

    def call(self, request: CallRequest, on_progress: ProgressCallback,
             guard: CallGuard = CallGuard()) -> asyncio.Future[dict[str, Any]]:
        loop = self._loop
        future: asyncio.Future[dict[str, Any]] = loop.create_future()
        if not self._alive:
            # The contract the pool relies on: a dead sandbox is never handed a call.
            self._backend.calls_to_dead += 1
            future.set_exception(SandboxFailed("the sandbox is dead"))
            return future
        self.last_call = request, guard
        self._future = future
        if self._backend.handler is echo_handler:
            # The default answers at the loop's next turn, as a sandbox's reply would, with no task of
            # its own: the fake backend's figures in `make bench` are then the daemon's work alone.
            loop.call_soon(_answer, future, _echo(request))
            return future
        self.aborted = asyncio.Event()

        async def run() -> None:
            try:
                result = await self._backend.handler(request, on_progress, self.aborted)
            except SandboxFailed as exc:
                if not future.done():
                    future.set_exception(exc)
                return
            if not future.done():
                future.set_result(result)

        self._task = loop.create_task(run())
        return future

    def cancel(self, reason: str) -> None:
        self.cancel_reasons.append(reason)
        self.aborted.set()

    def on_exit(self, callback: Callable[[], None]) -> None:
        self._exit_callbacks.append(callback)

    def pause_reading(self) -> None:
        self.reading_paused = True

    def resume_reading(self) -> None:
        self.reading_paused = False

    def on_output(self, callback: Callable[[str], None]) -> None:
        pass  # a fake sandbox prints nothing

    def stop(self) -> None:
        """Destroyed by the pool: no exit callbacks (those are for deaths of its own)."""
        self._alive = False
        if self._task is not None:
            self._task.cancel()

    def die(self, message: str = "the sandbox died") -> None:
        """Simulate the sandbox dying on its own (OOM, process.exit, killed)."""
        if not self._alive:
            return
        self._alive = False
        if self._task is not None:
            self._task.cancel()
        if self._future is not None and not self._future.done():
            self._future.set_exception(SandboxFailed(message))
        for callback in self._exit_callbacks:
            callback()


class FakeBackend:
    name = "fake"
    transport = "memory"

    def __init__(self, handler: Handler = echo_handler) -> None:
        self.handler = handler
        self.start_delay = 0.0
        self.destroy_delay = 0.0
        self.start_error: Exception | None = None
        self.sandboxes: dict[str, FakeSandbox] = {}  # live, owned by this backend
        self.destroyed: list[str] = []
        self.orphans: list[str] = []
        self.starts = 0
        self.calls_to_dead = 0
        self.reconfigured: list[SandboxConfig] = []
        self._ids = itertools.count(1)

    async def start(self, spec: SandboxSpec) -> FakeSandbox:
        self.starts += 1
        if self.start_delay:
            await asyncio.sleep(self.start_delay)
        if self.start_error is not None:
            raise self.start_error
        sandbox = FakeSandbox(self, f"fake-{next(self._ids)}", spec.user)
        self.sandboxes[sandbox.id] = sandbox
        return sandbox

    async def destroy(self, sandbox: FakeSandbox) -> None:
        if self.destroy_delay:
            await asyncio.sleep(self.destroy_delay)
        if sandbox.id in self.sandboxes:
            del self.sandboxes[sandbox.id]
            self.destroyed.append(sandbox.id)
        sandbox.stop()

    def reconfigure(self, config: SandboxConfig) -> None:
        self.reconfigured.append(config)

    async def remove_orphans(self) -> int:
        count, self.orphans = len(self.orphans), []
        return count

    async def preflight(self, config: SandboxConfig | None = None) -> None:
        pass

    def entry_path(self, tool: Tool) -> str:
        return str(tool.entry)

    async def esbuild(self, directory: Any) -> None:
        return None  # in-memory sandboxes run no shim: no transpile cache

    async def close(self) -> None:
        return None

    def unavailable(self) -> None:
        """Make every start fail as if the engine were down."""
        self.start_error = BackendUnavailable("the fake engine is down")
