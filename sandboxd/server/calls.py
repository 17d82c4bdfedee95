"""One tools/call from request to answer.

``ConnectionCalls`` is one connection's calls in flight by request id (the tools/call
method, cancels, a disconnect, back-pressure); ``Calls`` is every call in flight on
the daemon and the lifecycle they share (refused while stopping → params checked,
after a tools scan if the tools changed → run → answered); ``CallRunner`` runs one
call from checked params to result: acquire → call → release.

Each phase has one deadline: the queue (pool.acquire_timeout_ms), the call
(timeoutMs, capped), and the cancel grace. A call's future is settled by the
first of: the shim's answer, the sandbox dying, the deadline, or the grace
running out after a cancel; no extra task is created on this hot path.
"""

from __future__ import annotations

import asyncio
import enum
import functools
import json
import secrets
import time
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable, Mapping

from sandboxd import strictjson
from sandboxd.config import Config
from sandboxd.egress.secrets import StandIns, value_problem
from sandboxd.errors import BackendUnavailable, InvalidParams, Overloaded, SandboxdError, SandboxFailed, ShuttingDown
from sandboxd.logging import get_logger, secret_values, source
from sandboxd.sandbox.backend import Backend, CallRequest, OutputLimits, Sandbox, reserved_env
from sandboxd.sandbox.pool import Pool
from sandboxd.server.rpc import is_request_id, notification
from sandboxd.tools.discovery import ScanNeeded, Tool, ToolCatalog
from sandboxd.tools.schema import sensitive_names, validate_arguments
from sandboxd.users import check_user

log = get_logger("sandboxd.calls")

# Set by the daemon itself (docs/tools.md); a call may not override them.


# How a call that ends in a JSON-RPC error (not a result) is counted and logged.
_ERROR_STATUS: dict[type[Exception], str] = {Overloaded: "overloaded", BackendUnavailable: "unavailable", ShuttingDown: "shutting_down"}


class _Timeout(Exception):
    pass


class _GraceExpired(Exception):
    pass


class _Killed(Exception):
    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class _ProgressCapExceeded(Exception):
    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class _ProgressBudget:
    """Forwards a call's progress until it passes calls.max_progress_updates or _bytes, then fails the call.

    A progress flood costs the daemon CPU and the client bandwidth whoever reads it;
    past the cap the call ends as crashed and its sandbox is replaced.
    """

    def __init__(self, max_updates: int, max_bytes: int, forward: Callable[[list[Any]], None]) -> None:
        self._max_updates, self._max_bytes, self._forward = max_updates, max_bytes, forward
        self._updates = self._bytes = 0
        self.future: asyncio.Future[dict[str, Any]] | None = None

    def __call__(self, content: list[Any]) -> None:
        if self.future is None or self.future.done():
            return
        self._updates += 1
        self._bytes += len(json.dumps(content, separators=(",", ":")))
        if self._updates > self._max_updates:
            _fail(self.future, _ProgressCapExceeded(
                f"The tool sent more than {self._max_updates} progress updates (calls.max_progress_updates); "
                "the call was stopped and its sandbox replaced. Report progress less often."))
        elif self._bytes > self._max_bytes:
            _fail(self.future, _ProgressCapExceeded(
                f"The tool sent more than {self._max_bytes} bytes of progress (calls.max_progress_bytes); "
                "the call was stopped and its sandbox replaced. Send short progress messages; put data in the result."))
        else:
            self._forward(content)


@dataclass
class CallParams:
    user: str
    tool: Tool
    arguments: dict[str, Any]
    tool_call_id: str
    env: dict[str, str]
    timeout_s: float

    def secrets(self) -> list[Any]:
        names = sensitive_names(self.tool.schema)
        return list(self.env.values()) + [v for k, v in self.arguments.items() if k in names]


def parse_call_params(params: Any, catalog: ToolCatalog, config: Config, *, since: float) -> CallParams:
    """Check everything about a tools/call before anything runs (-32602 on any problem).

    The tool is looked up in the catalog's last scans (``since``: when the request arrived);
    ScanNeeded means the tools changed and must be scanned, off the event loop, first.
    """
    if not isinstance(params, dict):
        raise InvalidParams("tools/call needs params {\"user\", \"name\", \"arguments\"}.")
    user = check_user(params.get("user"))
    name = params.get("name")
    if not isinstance(name, str) or not name:
        raise InvalidParams("'name' is required: the tool to call, as tools/list names it.")
    meta = params.get("_meta")
    if meta is not None and not isinstance(meta, dict):
        raise InvalidParams("'_meta' must be an object like {\"progressToken\": \"t1\"}.")
    token = meta.get("progressToken") if meta is not None else None
    if token is not None and (isinstance(token, bool) or not isinstance(token, (str, int, float))
                              or isinstance(token, int) and abs(token) > strictjson.MAX_DOUBLE_INT):
        raise InvalidParams("'_meta.progressToken' must be a string or a number (that fits a double).")
    tool = catalog.lookup(name, user, since=since)
    if tool is None:
        known = ", ".join(catalog.known_names(user)[:20]) or "none"
        raise InvalidParams(f"unknown tool {name!r} for {user}; tools/list shows the tools (known: {known}).")
    arguments = params.get("arguments", {})
    arguments = validate_arguments(tool.schema, {} if arguments is None else arguments, tool=tool.name)
    tool_call_id = params.get("toolCallId")
    if tool_call_id is None:
        tool_call_id = f"call_{secrets.token_hex(8)}"
    elif not isinstance(tool_call_id, str) or not tool_call_id or len(tool_call_id) > 256:
        raise InvalidParams("'toolCallId' must be a non-empty string of at most 256 characters.")
    env = _check_env(params.get("env"), config.calls.allowed_env, config.egress.secrets)
    timeout_ms = params.get("timeoutMs")
    if timeout_ms is None:
        timeout_ms = config.calls.default_timeout_ms
    elif isinstance(timeout_ms, bool) or not isinstance(timeout_ms, (int, float)) or timeout_ms <= 0:
        raise InvalidParams("'timeoutMs' must be a positive number of milliseconds.")
    timeout_ms = min(timeout_ms, config.calls.max_timeout_ms)
    return CallParams(user, tool, arguments, tool_call_id, env, timeout_ms / 1000)


def _check_env(env: Any, allowed: list[str], secrets: Mapping[str, list[str]] | None = None) -> dict[str, str]:
    if env is None:
        return {}
    if not isinstance(env, dict):
        raise InvalidParams("'env' must be an object of string values.")
    problems = []
    for key, value in env.items():
        if reserved_env(key):
            problems.append(f"{key} is set by sandboxd and cannot be overridden")
        elif key not in allowed:
            problems.append(f"{key} is not an allowed env name (allowed: {', '.join(allowed)}; see calls.allowed_env)")
        elif not isinstance(value, str):
            problems.append(f"{key} must be a string")
        elif secrets and key in secrets and (problem := value_problem(key, value)):
            problems.append(problem)
    if problems:
        # Names only: env values are secrets and never appear in an error.
        raise InvalidParams("forbidden env: " + "; ".join(problems) + ".", data={"names": sorted(env)})
    return dict(env)


class Phase(enum.Enum):
    CHECKING = "checking"  # params checked, maybe a tools scan: a cancel is only noted
    QUEUED = "queued"  # waiting for a sandbox: a cancel stops the wait
    RUNNING = "running"  # in a sandbox: a cancel fires the tool's AbortSignal, and the grace runs
    DONE = "done"


@dataclass(eq=False)
class CallContext:
    """A call in flight: what a cancel notification, a disconnect or shutdown acts on.

    Only the runner moves it through its phases (checking → queued → running → done);
    everyone else may ``cancel`` or ``kill`` it.
    """

    request_id: Any
    grace: float = 2.0  # s a cancelled tool has to stop (calls.cancel_grace_ms), set by the runner
    phase: Phase = field(default=Phase.CHECKING, init=False)
    task: asyncio.Task[Any] | None = field(default=None, init=False)  # the one running the call
    sandbox: Sandbox | None = field(default=None, init=False)
    cancel_reason: str | None = field(default=None, init=False)
    queue_wait_s: float | None = field(default=None, init=False)  # set once a sandbox is acquired
    client_gone: bool = field(default=False, init=False)  # its connection closed: nobody reads its answer
    _future: asyncio.Future[dict[str, Any]] | None = field(default=None, init=False, repr=False)
    _timers: list[asyncio.TimerHandle] = field(default_factory=list, init=False, repr=False)

    def cancel(self, reason: str, *, grace: float | None = None) -> None:
        """Stop the call, and answer it ``cancelled``; a tool still running after the grace is killed."""
        if self.cancel_reason is not None or self.phase is Phase.DONE:
            return
        self.cancel_reason = reason
        if grace is not None:
            self.grace = grace
        # Not while checking: a task cancelled before its first step never runs its
        # body, so the call would go unanswered. The runner sees cancel_reason instead.
        if self.phase is Phase.QUEUED and self.task is not None:
            self.task.cancel()
        elif self.phase is Phase.RUNNING and self.sandbox is not None and self._future is not None:
            self.sandbox.cancel(reason)  # the tool's AbortSignal fires now
            self._timers.append(asyncio.get_running_loop().call_later(self.grace, _fail, self._future, _GraceExpired()))

    def kill(self, message: str) -> bool:
        """End a running call now, answered ``cancelled`` with ``message``; its sandbox is replaced.
        False if no tool is running (nothing to kill)."""
        if self.phase is not Phase.RUNNING or self._future is None or self._future.done():
            return False
        self._future.set_exception(_Killed(message))
        return True

    # -- moved on by the runner only ------------------------------------------

    def enter_queue(self) -> None:
        self.phase = Phase.QUEUED

    def start_running(self, sandbox: Sandbox, future: asyncio.Future[dict[str, Any]], timeout_s: float) -> None:
        self.phase, self.sandbox, self._future = Phase.RUNNING, sandbox, future
        self._timers.append(asyncio.get_running_loop().call_later(timeout_s, _fail, future, _Timeout()))

    def finish(self) -> None:
        self.phase = Phase.DONE
        for timer in self._timers:
            timer.cancel()


def _fail(future: asyncio.Future[Any], exc: BaseException) -> None:
    if not future.done():
        future.set_exception(exc)


def result(status: str, content: list[Any], started: float, *, is_error: bool | None = None, details: Any = None) -> dict[str, Any]:
    out: dict[str, Any] = {
        "content": content,
        "isError": status != "ok" if is_error is None else is_error,
        "status": status,
        "durationMs": round((time.monotonic() - started) * 1000),
    }
    if details is not None:
        out["details"] = details
    return out


def _not_started(ctx: CallContext, started: float) -> dict[str, Any]:
    return result("cancelled", text(f"The call was cancelled before it started ({ctx.cancel_reason})."), started)


def text(message: str) -> list[dict[str, str]]:
    return [{"type": "text", "text": message}]


class CallRunner:
    def __init__(self, config: Config, pool: Pool, backend: Backend) -> None:
        self.config = config
        self.pool = pool
        self.backend = backend
        self.counts: dict[str, int] = {}
        # Told (tool, status, duration_s, queue_wait_s) as each call ends; the metrics hang here.
        self.on_call: Callable[[str, str, float, float | None], None] | None = None

    async def run(self, call: CallParams, ctx: CallContext, on_progress: Callable[[list[Any]], None]) -> dict[str, Any]:
        started = time.monotonic()
        ctx.task = asyncio.current_task()
        try:
            with secret_values(call.secrets()):
                outcome = await self._run(call, ctx, on_progress, started)
        except asyncio.CancelledError:
            if ctx.cancel_reason is None:
                raise  # the daemon itself is stopping the task
            outcome = _not_started(ctx, started)  # cancelled while it waited for a sandbox
        except Exception as exc:
            error = exc.message if isinstance(exc, SandboxdError) else None
            self._record(call, ctx, _ERROR_STATUS.get(type(exc), "internal_error"), time.monotonic() - started, error)
            raise
        # Logged and counted just after the answer is written, like the pool release in _run.
        asyncio.get_running_loop().call_soon(self._record, call, ctx, outcome["status"], time.monotonic() - started)
        return outcome

    def count_refused(self, params: Any, exc: SandboxdError) -> None:
        """A call refused before its params were read (the daemon stopping): counted and logged like the rest.

        Not in the metrics: they stop being served when shutdown begins, before any such refusal.
        """
        status = _ERROR_STATUS.get(type(exc), "internal_error")
        self.counts[status] = self.counts.get(status, 0) + 1
        name = params.get("name") if isinstance(params, dict) else None
        log.info("call", tool=name[:200] if isinstance(name, str) else None, status=status, error=exc.message,
                 budget=source("calls", "refused while stopping"))

    def _record(self, call: CallParams, ctx: CallContext, status: str, duration_s: float, error: str | None = None) -> None:
        """The one log event per call, and its counters. No arguments or env: only who, what and how it went."""
        self.counts[status] = self.counts.get(status, 0) + 1
        log.info(
            "call",
            user=call.user,
            tool=call.tool.name,
            tool_call_id=call.tool_call_id,
            status=status,
            duration_ms=round(duration_s * 1000),
            queue_ms=None if ctx.queue_wait_s is None else round(ctx.queue_wait_s * 1000),
            sandbox=None if ctx.sandbox is None else ctx.sandbox.id,
            **({"error": error} if error else {}),
            budget=source("user", call.user),
        )
        if self.on_call is not None:
            self.on_call(call.tool.name, status, duration_s, ctx.queue_wait_s)

    async def _run(self, call: CallParams, ctx: CallContext, on_progress: Callable[[list[Any]], None], started: float) -> dict[str, Any]:
        ctx.grace = self.config.calls.cancel_grace_ms / 1000
        if ctx.cancel_reason is not None:  # cancelled before it got here
            return _not_started(ctx, started)
        # The sandbox holds stand-ins for egress.secrets, the egress proxy the values (egress/secrets.py).
        env, stand_ins = StandIns.for_call(call.env, self.config.egress.secrets)
        ctx.enter_queue()
        queued_at = time.monotonic()
        pooled = await self.pool.acquire(call.user)
        ctx.queue_wait_s = time.monotonic() - queued_at
        reusable = False
        calls = self.config.calls
        try:
            request = CallRequest(
                tool_call_id=call.tool_call_id,
                entry=self.backend.entry_path(call.tool),
                arguments=call.arguments,
                env=env,
                max_result_bytes=calls.max_result_bytes,
                output_limits=OutputLimits(calls.output_rate_bytes, calls.output_burst_bytes, calls.idle_output_bytes),
                tool=call.tool.name,
                stand_ins=stand_ins,
            )
            assert pooled.sandbox is not None
            progress = _ProgressBudget(calls.max_progress_updates, calls.max_progress_bytes, on_progress)
            future = progress.future = pooled.sandbox.call(request, progress)
            ctx.start_running(pooled.sandbox, future, call.timeout_s)
            try:
                answer = await future
            except _Timeout:
                return result("timeout", text(
                    f"The tool did not finish within {call.timeout_s:g} s and was stopped; "
                    "its sandbox was replaced. Ask for less work per call or raise timeoutMs."), started)
            except _GraceExpired:
                return result("cancelled", text(
                    f"The call was cancelled ({ctx.cancel_reason}); the tool did not stop within "
                    f"{ctx.grace:g} s, so its sandbox was killed and replaced."), started)
            except _Killed as exc:
                return result("cancelled", text(exc.message), started)
            except (SandboxFailed, _ProgressCapExceeded) as exc:
                return result("crashed", text(exc.message), started)
            # The shim says when a tool left processes running or /tmp full (docs/shim.md).
            retire = answer.get("retire")
            reusable = not retire
            if retire:
                log.info("sandbox_retired", user=call.user, tool=call.tool.name, sandbox=pooled.sandbox.id,
                         reason=str(retire)[:500], budget=source("user", call.user))
            content = answer.get("content")
            if not isinstance(content, list):
                content = text("The tool's sandbox returned a malformed result.")
            if ctx.cancel_reason is not None:
                return result("cancelled", content, started, is_error=True, details=answer.get("details"))
            status = "ok" if answer.get("status") == "ok" and not answer.get("isError") else "error"
            return result(status, content, started, details=answer.get("details"))
        finally:
            ctx.finish()
            # Released just after the answer is written (connection.py sends it when run returns):
            # the caller's path ends at the answer, the pool's bookkeeping need not sit on it.
            asyncio.get_running_loop().call_soon(functools.partial(self.pool.release, pooled, reusable=reusable))


class Calls:
    """Every tools/call in flight on the daemon, and the lifecycle each goes through."""

    def __init__(self, runner: CallRunner, catalog: ToolCatalog, *, stopping: Callable[[], bool]) -> None:
        self.runner = runner
        self.catalog = catalog
        self._stopping = stopping
        self.in_flight: set[CallContext] = set()

    def admit(self, params: Any) -> None:
        """Refuse a new call once shutdown has begun (counted and logged like any call)."""
        if self._stopping():
            refusal = shutting_down()
            self.runner.count_refused(params, refusal)
            raise refusal

    async def run(self, ctx: CallContext, params: Any, arrived: float, on_progress: Callable[[list[Any]], None],
                  call: CallParams | None) -> dict[str, Any] | None:
        """Check (``call`` is None: after a tools scan), run and answer one call; None: its client is gone."""
        while call is None:
            await self.catalog.refresh(params.get("user"), since=arrived)
            if ctx.client_gone:
                return None
            try:
                call = self.check(params, arrived)  # the lookup now trusts the scan just made
            except ScanNeeded:
                continue
        return await self.runner.run(call, ctx, on_progress)

    def check(self, params: Any, arrived: float) -> CallParams:
        return parse_call_params(params, self.catalog, self.runner.config, since=arrived)


def shutting_down() -> ShuttingDown:
    return ShuttingDown("sandboxd is shutting down and takes no new calls; retry once it is back.")


class ConnectionCalls:
    """One connection's calls in flight, by request id: what its cancels, its disconnect and its back-pressure act on."""

    def __init__(self, calls: Calls, send: Callable[[dict[str, Any]], None]) -> None:
        self._calls = calls
        self._send = send
        self._by_id: dict[Any, CallContext] = {}
        self._writing_paused = False  # the client reads no more
        self._paused_sandboxes: set[Any] = set()  # sandboxes of our calls we stopped reading

    def get(self, request_id: Any) -> CallContext | None:
        return self._by_id.get(request_id)

    def start(self, request_id: Any, params: Any) -> Awaitable[dict[str, Any] | None]:
        """The tools/call method: checks what it can now, returns the rest of the call to await."""
        arrived = time.monotonic()
        if request_id in self._by_id:
            raise InvalidParams(f"id {request_id!r} is already used by a call in flight on this connection; use a fresh id.")
        self._calls.admit(params)
        try:
            call: CallParams | None = self._calls.check(params, arrived)
        except ScanNeeded:
            # The tools changed since the last scan (the warm path is a few stat calls, here);
            # the call is in flight from now, so that a cancel, a disconnect or a reused id finds it.
            call = None
        assert isinstance(params, dict)  # check() refused anything else
        meta = params["_meta"] if isinstance(params.get("_meta"), dict) else {}
        ctx = CallContext(request_id)
        self._by_id[request_id] = ctx
        self._calls.in_flight.add(ctx)
        return self._run(ctx, params, arrived, meta.get("progressToken", request_id), call)

    async def _run(self, ctx: CallContext, params: dict[str, Any], arrived: float, token: Any,
                   call: CallParams | None) -> dict[str, Any] | None:
        counter = 0

        def on_progress(content: list[Any]) -> None:
            nonlocal counter
            counter += 1
            if self._writing_paused:
                self._pause_sandbox(ctx)
            self._send(notification("notifications/progress", {"progressToken": token, "progress": counter, "content": content}))

        try:
            return await self._calls.run(ctx, params, arrived, on_progress, call)
        finally:
            # Before its sandbox goes back to the pool (just after the answer): another caller must find it reading.
            if ctx.sandbox is not None and ctx.sandbox in self._paused_sandboxes:
                self._paused_sandboxes.discard(ctx.sandbox)
                ctx.sandbox.resume_reading()
            if self._by_id.get(ctx.request_id) is ctx:
                del self._by_id[ctx.request_id]
            self._calls.in_flight.discard(ctx)

    def cancel(self, params: Any) -> None:
        """notifications/cancelled: cancel the call of ``params.requestId`` if it is ours and in flight."""
        if not isinstance(params, dict):
            return
        request_id = params.get("requestId")
        # Only ids a request can have; a list or an object would not even hash.
        ctx = self._by_id.get(request_id) if is_request_id(request_id) else None
        if ctx is not None:
            reason = params.get("reason")
            ctx.cancel(reason if isinstance(reason, str) and reason else "cancelled by the client")

    def client_gone(self) -> None:
        """A client that goes away cancels every call it has in flight."""
        for ctx in list(self._by_id.values()):
            ctx.client_gone = True
            ctx.cancel("client disconnected")

    def pause(self) -> None:
        """The client reads no more: stop reading the sandboxes of its running calls (one that starts
        meanwhile is paused at its first progress), so that their output waits in the sandbox."""
        self._writing_paused = True
        for ctx in self._by_id.values():
            self._pause_sandbox(ctx)

    def resume(self) -> None:
        self._writing_paused = False
        for sandbox in self._paused_sandboxes:
            sandbox.resume_reading()
        self._paused_sandboxes.clear()

    def _pause_sandbox(self, ctx: CallContext) -> None:
        sandbox = ctx.sandbox
        if ctx.phase is Phase.RUNNING and sandbox is not None and sandbox not in self._paused_sandboxes:
            sandbox.pause_reading()
            self._paused_sandboxes.add(sandbox)
