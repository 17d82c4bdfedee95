"""The tools/call method (``Calls``): admit → check (after a tools scan when the tools changed) →
run → answer; what shutdown waits for is ``Calls.in_flight``."""

from __future__ import annotations

import time
from typing import Any, Callable

from sandboxd.errors import ShuttingDown
from sandboxd.server.calls.context import CallContext
from sandboxd.server.calls.holds import UserHolds
from sandboxd.server.calls.params import CallParams, parse_call_params
from sandboxd.server.calls.runner import CallRunner
from sandboxd.server.rpc import Later
from sandboxd.tools.discovery import ScanNeeded, ToolCatalog
from sandboxd.wire import Message, progress


class Calls:
    """Every tools/call on the daemon goes through here: admit → check → run → answer."""

    def __init__(self, runner: CallRunner, catalog: ToolCatalog, *, stopping: Callable[[], bool]) -> None:
        self.runner = runner
        self.catalog = catalog
        self._stopping = stopping
        self.in_flight: set[CallContext] = set()  # from their first step to their answer: what shutdown waits for
        self.holds = UserHolds(lambda: self.in_flight)  # users whose calls wait (an export reading their folder)

    def start(self, send: Callable[[Message], None], request_id: Any, params: Any) -> Later:
        """The tools/call method (``send``: to its client): admit and check what can be checked now;
        the rest is the dispatcher's to await, and the context its cancels reach."""
        arrived = time.monotonic()
        if self._stopping():
            refusal = ShuttingDown()
            self.runner.count_refused(params, refusal)
            raise refusal
        try:
            call: CallParams | None = self._check(params, arrived)
        except ScanNeeded:
            # The tools changed since the last scan (the warm path is one inotify read, here): the
            # call is checked after a new scan, in flight from now, so that a cancel or a disconnect finds it.
            call = None
        assert isinstance(params, dict)  # the check refused anything else
        meta = params.get("_meta")
        token = meta.get("progressToken", request_id) if isinstance(meta, dict) else request_id
        ctx = CallContext()
        on_progress = _ProgressNotifier(ctx, token, send)
        return Later(self.answer(ctx, params, arrived, call, on_progress), ctx)

    async def answer(self, ctx: CallContext, params: dict[str, Any], arrived: float, call: CallParams | None,
                     on_progress: Callable[[list[Any]], None]) -> dict[str, Any]:
        """Check (``call`` is None: after a tools scan), run, and give the answer to send."""
        # From its first step, at the loop's next turn (a shutdown, which waits on the loop, finds
        # it), not from start: the dispatcher drops a call it refuses unstarted.
        self.in_flight.add(ctx)
        try:
            while call is None:
                await self.catalog.refresh(params.get("user"), since=arrived)
                try:
                    call = self._check(params, arrived)  # the lookup now trusts the scan just made
                except ScanNeeded:
                    continue
            if self.holds.held:  # an export reads some user's folder live: that user's calls wait for its end
                await self.holds.wait(call.user)
            ctx.user = call.user  # from here, an export of the user waits for this call
            return await self.runner.run(call, ctx, on_progress)
        finally:
            self.in_flight.discard(ctx)

    def _check(self, params: Any, arrived: float) -> CallParams:
        return parse_call_params(params, self.catalog, self.runner.config, since=arrived)


class _ProgressNotifier:
    """A call's progress as notifications to its client, numbered from 1 (docs/protocol.md).

    An object, not a closure over a counter: every call makes one and few send progress, so it is
    the smaller of the two."""

    __slots__ = ("_ctx", "_token", "_send", "_sent")

    def __init__(self, ctx: CallContext, token: Any, send: Callable[[Message], None]) -> None:
        self._ctx, self._token, self._send, self._sent = ctx, token, send, 0

    def __call__(self, content: list[Any]) -> None:
        self._ctx.progressed()
        self._sent += 1
        self._send(progress(self._token, self._sent, content))
