"""The daemon's side of the shim protocol (docs/shim.md), for any byte transport.

A backend feeds the shim's protocol stream (its socket, or its stdout in attach
mode) into ``feed`` and gives a ``write`` function for the other direction.
Everything the shim says is untrusted. The shim speaks only when
asked: ``ready`` once, then progress and one answer for the running call. Anything
else (a line that is not the protocol or is too long, a message while no call runs,
progress or an answer for another call, an unknown method) means a tool wrote to the
protocol stream: the sandbox is broken (``SandboxFailed``) and replaced.

Tool output has a budget in every state (``OutputLimits``): a token bucket whose
emptiness pauses reading the sandbox's output, so the tool blocks on its own full
pipe, and a small allowance while no call runs, past which the sandbox is broken.
"""

from __future__ import annotations

import asyncio
import collections
import itertools
import time
from typing import Any, Callable

from sandboxd import strictjson, wire
from sandboxd.egress.contract import EgressCall
from sandboxd.egress.grants import CallGrant
from sandboxd.errors import SandboxFailed
from sandboxd.lines import LineBuffer
from sandboxd.logging import get_logger, masking, source
from sandboxd.rules.secrets import NO_STAND_INS
from sandboxd.rules.tool_network import ToolNetwork
from sandboxd.sandbox.backend import CallGuard, CallRequest, OutputLimits, ProgressCallback

_log = get_logger("sandboxd.sandbox")

SHIM_PROTOCOL = 2


class ShimChannel:
    def __init__(self, write: Callable[[bytes], None], *, max_line_bytes: int,
                 on_broken: Callable[[SandboxFailed], None] | None = None) -> None:
        self._write = write
        self._on_broken = on_broken
        self._lines = LineBuffer(max_line_bytes)
        self._ids = itertools.count(1)
        self._call_id: int | None = None
        self._call_future: asyncio.Future[dict[str, Any]] | None = None
        self._on_progress: ProgressCallback | None = None
        self._loop = asyncio.get_running_loop()
        self.ready: asyncio.Future[dict[str, Any]] = self._loop.create_future()
        self.closed: SandboxFailed | None = None

    # -- daemon → shim -----------------------------------------------------

    def call(self, request: CallRequest, on_progress: ProgressCallback) -> asyncio.Future[dict[str, Any]]:
        future: asyncio.Future[dict[str, Any]] = self._loop.create_future()
        if self.closed is not None:
            future.set_exception(self.closed)
            return future
        if self._call_future is not None and not self._call_future.done():
            # The pool hands a sandbox to one call at a time; this is a daemon bug.
            raise RuntimeError("sandbox already has a call in flight")
        self._call_id = next(self._ids)
        self._call_future = future
        self._on_progress = on_progress
        self._write(wire.encode(wire.request(self._call_id, "call", request.to_params())))
        return future

    def cancel(self, reason: str) -> None:
        if self._call_future is not None and not self._call_future.done() and self.closed is None:
            self._write(wire.encode(wire.notification("cancel", {"id": self._call_id, "reason": reason})))

    def shutdown(self) -> None:
        if self.closed is None:
            self._write(wire.encode(wire.notification("shutdown")))

    @property
    def busy(self) -> bool:
        """A call was sent and the shim has not answered it (even if the daemon gave up on it)."""
        return self._call_future is not None

    # -- shim → daemon -----------------------------------------------------

    def feed(self, data: bytes) -> None:
        """Bytes from the shim's protocol stream."""
        if self.closed is not None:
            return
        for line in self._lines.feed(data):
            if isinstance(line, bytes):
                self._handle_line(line)
            else:
                self.fail(f"the tool's output line exceeded {self._lines.max_line} bytes; its sandbox was stopped.")
            if self.closed is not None:
                return

    def _handle_line(self, line: bytes) -> None:
        try:
            message = strictjson.loads_line(line)
        except (ValueError, RecursionError):
            self.fail("the sandbox wrote something that is not the shim protocol on its protocol stream.")
            return
        if not isinstance(message, dict):
            self.fail("the sandbox sent a protocol message that is not an object.")
            return
        method = message.get("method")
        if method == "ready" and not self.ready.done():
            self.ready.set_result(_params(message))
            return
        # The shim never speaks unasked (docs/shim.md): whatever else comes while no call
        # runs, or is about another call, was written by the tool. A forged line must not
        # pass as a result, and a sandbox whose tool can write here cannot be trusted again.
        if self._call_future is None:
            self.fail(f"the sandbox sent a protocol message ({_kind(message)}) while no call was running: "
                      "a tool wrote to the shim's protocol stream. Its sandbox was replaced.")
        elif method is None and message.get("id") == self._call_id and ("result" in message or "error" in message):
            self._settle(message)  # first: every call has its answer, few have progress
        elif method == "progress" and (params := _params(message)).get("id") == self._call_id:
            if self._on_progress is not None and not self._call_future.done():  # dropped once the daemon gave up
                content = params.get("content")
                self._on_progress(content if isinstance(content, list) else [])
        else:
            self.fail(f"the sandbox sent a protocol message ({_kind(message)}) that is not about the running call: "
                      "a tool wrote to the shim's protocol stream. Its sandbox was replaced.")

    def _settle(self, message: dict[str, Any]) -> None:
        assert self._call_future is not None
        future, self._call_future, self._on_progress = self._call_future, None, None
        if future.done():
            return
        if "error" in message:
            error = message.get("error") or {}
            text = error.get("message") if isinstance(error, dict) else str(error)
            future.set_exception(SandboxFailed(f"the shim refused the call: {text}"))
            return
        result = message.get("result")
        if not isinstance(result, dict):
            future.set_exception(SandboxFailed("the shim answered with a result that is not an object."))
            return
        future.set_result(result)

    def fail(self, message: str) -> None:
        """The sandbox broke the protocol or its budget: close, and say so (the pool replaces it)."""
        if self.closed is not None:
            return
        error = SandboxFailed(message)
        self.close(error)
        if self._on_broken is not None:
            self._on_broken(error)

    def close(self, error: SandboxFailed) -> None:
        """The transport ended or broke the protocol: fail whatever waits on it."""
        if self.closed is not None:
            return
        self.closed = error
        if not self.ready.done():
            self.ready.set_exception(error)
            self.ready.exception()  # mark retrieved: a start that failed elsewhere must not warn
        if self._call_future is not None and not self._call_future.done():
            self._call_future.set_exception(error)
        self._call_future = None


def _params(message: dict[str, Any]) -> dict[str, Any]:
    """A message's params, or none when they are not an object."""
    params = message.get("params")
    return params if isinstance(params, dict) else {}


def _kind(message: dict[str, Any]) -> str:
    """What a stray message was, for the error: its method, or that it was an answer. Never its content."""
    method = message.get("method")
    if isinstance(method, str):
        return f"method {method[:40]!r}"
    return "an answer" if "result" in message or "error" in message else "no method"


class ShimSandbox:
    """What every shim-backed sandbox shares: the channel, output budgets, a stderr tail, exit handling.

    Subclasses provide ``_write`` (bytes to the shim's protocol stream), ``_reading`` (pause or
    resume reading its protocol and output streams) and ``exit_reason`` (why the
    sandbox ended, in words an agent can act on).
    """

    STDERR_TAIL_LINES = 20
    # Past this many distinct secrets (calls with fresh tokens), stderr text is no longer logged:
    # masking must cover every secret the sandbox was ever given, since a timer may print one later.
    MAX_MASKED_SECRETS = 1024

    def __init__(self, sandbox_id: str, user: str, max_line_bytes: int) -> None:
        self.id = sandbox_id
        self.user = user
        self.channel = ShimChannel(self._write, max_line_bytes=max_line_bytes, on_broken=self._broken)
        self.stderr_tail: collections.deque[str] = collections.deque(maxlen=self.STDERR_TAIL_LINES)
        self.destroying = False
        self._exited = False
        self._exit_notified = False
        self._exit_callbacks: list[Callable[[], None]] = []
        self._stderr_partial = b""
        # Called with each line of tool output as it arrives (`sandboxd run` shows them to the developer).
        self._on_output: Callable[[str], None] | None = None
        # Every secret of every call this sandbox ran: its output is masked against all of them.
        self._secrets: frozenset[str] = frozenset()
        # The output budget: the limits of the latest call (defaults before the first one).
        self._limits = OutputLimits()
        self._tokens = float(self._limits.output_burst_bytes)
        self._refilled_at = time.monotonic()
        self._idle_output = 0  # bytes of output since the last call ended
        self._output_paused = False  # the bucket is empty
        self._client_paused = False  # the running call's client reads no more
        self._refill: asyncio.TimerHandle | None = None
        self._running_tool: str | None = None
        self._stand_ins = NO_STAND_INS  # the running call's; none while idle: a stand-in is worth nothing after its call
        self._relay_port: int | None = None
        self._grant: CallGrant | None = None  # the running call's: ended when it is answered
        self._network: ToolNetwork | None = None  # the running tool's permissions.network, kept while idle

    def egress_context(self) -> EgressCall:
        """The tool running now (None when idle), every secret to mask, the running call's stand-ins and
        the relay port it was granted."""
        return EgressCall(self._running_tool, self._secrets, self._stand_ins, self._relay_port, self._grant,
                          self._network)

    @property
    def alive(self) -> bool:
        return not self._exited and self.channel.closed is None

    def call(self, request: CallRequest, on_progress: ProgressCallback,
             guard: CallGuard = CallGuard()) -> asyncio.Future[dict[str, Any]]:
        self.stderr_tail.clear()
        self._limits = guard.output_limits
        self._idle_output = 0
        if guard.secrets and len(self._secrets) <= self.MAX_MASKED_SECRETS:  # past it, no text is logged (stderr_data)
            self._secrets |= guard.secrets  # a new set: egress contexts handed out hold the old one
        future = self.channel.call(request, on_progress)
        self._running_tool = guard.tool or None
        # An empty StandIns serves as none, so the test is for None.
        self._stand_ins = request.stand_ins if request.stand_ins is not None else NO_STAND_INS
        self._relay_port = request.browser_relay.granted if request.browser_relay is not None else None
        self._grant = CallGrant()
        # Not cleared at the call's end: what the tool left running goes on under its tool's grant.
        self._network = guard.network
        future.add_done_callback(self._call_ended)
        return future

    def _call_ended(self, _future: asyncio.Future[dict[str, Any]]) -> None:
        self._running_tool = None
        self._stand_ins = NO_STAND_INS
        self._relay_port = None
        if self._grant is not None:  # a tunnel to the relay, a request with a secret: they end with the call
            self._grant.end()
            self._grant = None

    def cancel(self, reason: str) -> None:
        self.channel.cancel(reason)

    def on_exit(self, callback: Callable[[], None]) -> None:
        self._exit_callbacks.append(callback)

    def on_output(self, callback: Callable[[str], None]) -> None:
        self._on_output = callback

    def pause_reading(self) -> None:
        """The running call's client stopped reading: stop reading the shim's protocol stream too."""
        self._client_paused = True
        self._apply_reading()

    def resume_reading(self) -> None:
        self._client_paused = False
        self._apply_reading()

    def _apply_reading(self) -> None:
        if self.destroying:  # read to the end whatever asks otherwise (see drain)
            self._reading(protocol=True, output=True)
        else:
            self._reading(protocol=not self._client_paused, output=not self._output_paused)

    def _write(self, data: bytes) -> None:
        raise NotImplementedError

    def _reading(self, *, protocol: bool, output: bool) -> None:
        """Read (True) or stop reading (False) the protocol stream and the output stream."""
        raise NotImplementedError

    async def exit_reason(self) -> SandboxFailed:
        raise NotImplementedError

    def stderr_data(self, payload: bytes) -> None:
        """Tool output (tagged with its call id by the shim): kept as a tail for crash reports."""
        self._spend(len(payload))
        lines = (self._stderr_partial + payload).split(b"\n")
        self._stderr_partial = lines.pop()[-4096:]
        if not lines:
            return
        with masking(self._secrets):  # this runs outside any call's context
            for raw in lines:
                line = raw[:4096].decode("utf-8", "replace")
                self.stderr_tail.append(line)
                if len(self._secrets) <= self.MAX_MASKED_SECRETS:
                    _log.debug("tool_stderr", sandbox=self.id, line=line, budget=source("sandbox", self.id))
                else:
                    _log.debug("tool_stderr", sandbox=self.id, line=f"({len(line)} characters, not logged: "
                               f"too many secrets to mask)", budget=source("sandbox", self.id))
                if self._on_output is not None:
                    self._on_output(line)

    def _spend(self, size: int) -> None:
        """Charge output to the budget: an empty bucket pauses reading, idle output past its allowance breaks."""
        if self.destroying:
            return  # drained to its end, see drain()
        limits = self._limits
        if not self.channel.busy:
            self._idle_output += size
            if self._idle_output > limits.idle_output_bytes:
                self.channel.fail(
                    f"the sandbox wrote more than {limits.idle_output_bytes} bytes of output while no call was running "
                    "(calls.idle_output_bytes); it was replaced.")
                return
        self._top_up()
        self._tokens -= size
        if self._tokens < 0 and not self._output_paused:
            self._output_paused = True
            self._apply_reading()
            self._refill = asyncio.get_running_loop().call_later(-self._tokens / limits.output_rate_bytes, self._refilled)

    def _top_up(self) -> None:
        now = time.monotonic()
        self._tokens = min(float(self._limits.output_burst_bytes),
                           self._tokens + (now - self._refilled_at) * self._limits.output_rate_bytes)
        self._refilled_at = now

    def _refilled(self) -> None:
        self._top_up()
        if self._tokens < 0:  # the limits changed meanwhile
            self._refill = asyncio.get_running_loop().call_later(-self._tokens / self._limits.output_rate_bytes, self._refilled)
            return
        self._refill = None
        self._output_paused = False
        self._apply_reading()

    def drain(self) -> None:
        """The sandbox is being destroyed: read its streams to their ends, unthrottled.

        A paused stream never sees its end, and the end is how a backend learns the
        sandbox is gone (the process backend's wait() needs every pipe closed).
        """
        self.destroying = True
        if self._refill is not None:
            self._refill.cancel()
            self._refill = None
        self._apply_reading()

    def _broken(self, error: SandboxFailed) -> None:
        """The channel found the sandbox hostile: tell the pool now, so an idle one is destroyed at once."""
        if self.destroying:
            return
        _log.warning("sandbox_broken", sandbox=self.id, user=self.user, reason=error.message,
                     budget=source("user", self.user))
        self._notify_exit()

    def transport_closed(self) -> None:
        """The shim's stream ended: the sandbox exited, or sandboxd destroyed it."""
        if self._exited:
            return
        self._exited = True
        # The refill timer keeps running: the output stream must still reach its end, at the rate.
        if self.destroying:
            self.channel.close(SandboxFailed("the sandbox was stopped by sandboxd."))
            return
        asyncio.get_running_loop().create_task(self._report_exit())

    async def _report_exit(self) -> None:
        self.channel.close(await self.exit_reason())
        self._notify_exit()

    def _notify_exit(self) -> None:
        if self._exit_notified:
            return
        self._exit_notified = True
        for callback in self._exit_callbacks:
            callback()
