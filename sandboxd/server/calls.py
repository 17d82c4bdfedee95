"""One tools/call, from its request to its answer: admit → check → run → answer.

The dispatcher (rpc.py) owns the request: its id while it is in flight, and the cancel,
the disconnect and the back-pressure that reach its ``CallContext`` meanwhile. Here:

- ``Calls.start`` is the tools/call method: it admits the call (none once the daemon
  stops) and checks its params (``parse_call_params``), and hands the rest to the
  dispatcher to await;
- ``Calls.answer`` is that rest: a tools scan and the check when the tools changed,
  then the run; the call counts in ``Calls.in_flight`` (what shutdown waits for) until
  it is answered;
- ``CallRunner.run`` runs checked params: acquire a sandbox (pool.py) → call its shim
  (the sandbox's backend) → release it, every outcome a result (``sandboxd run`` runs
  its calls through it too).

Each phase has one deadline: the queue (pool.acquire_timeout_ms), the call
(timeoutMs, capped), and the cancel grace. A call's future is settled by the
first of: the shim's answer, the sandbox dying, the deadline, or the grace
running out after a cancel; no extra task is created on this hot path.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import functools
import itertools
import json
import re
import secrets
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Mapping

from sandboxd.config import Config
from sandboxd.egress.browser_relay import relay_for_call
from sandboxd.egress.secrets import StandIns, value_problem
from sandboxd.errors import (BackendUnavailable, InvalidParams, Overloaded, QuotaExceeded, SandboxdError, SandboxFailed,
                             ShuttingDown)
from sandboxd.logging import admitted, get_logger, secret_values, source
from sandboxd.sandbox.backend import Backend, CallGuard, CallRequest, OutputLimits, Sandbox, reserved_env
from sandboxd.sandbox.pool import Pool
from sandboxd.server.rpc import Later, is_request_id, notification
from sandboxd.tools.discovery import ScanNeeded, Tool, ToolCatalog
from sandboxd.tools.schema import sensitive_names, validate_arguments
from sandboxd.users import check_user

if TYPE_CHECKING:
    from sandboxd.storage.quota import Storage

log = get_logger("sandboxd.calls")

# How a call that ends in a JSON-RPC error (not a result) is counted and logged.
_ERROR_STATUS: dict[type[Exception], str] = {Overloaded: "overloaded", BackendUnavailable: "unavailable", ShuttingDown: "shutting_down",
                                             QuotaExceeded: "over_quota"}
# A call without env or sensitive arguments registers nothing to mask in its log lines.
_NO_SECRETS: contextlib.nullcontext[frozenset[str]] = contextlib.nullcontext(frozenset())
# What a tool's error says when a write failed on a full disk or quota (Node's and libc's wording).
_DISK_FULL = re.compile(r"EDQUOT|ENOSPC|[Dd]isk quota exceeded|[Nn]o space left on device")


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
    if token is not None and not is_request_id(token):  # a token is what an id may be (docs/protocol.md)
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
    """A call in flight: what a cancel notification, a disconnect, the client's back-pressure
    or shutdown acts on (the dispatcher's ``InFlight`` for a tools/call).

    Only the runner moves it through its phases (checking → queued → running → done);
    everyone else may ``cancel`` or ``kill`` it, or ``pause`` and ``resume`` its output.
    """

    grace: float = 2.0  # s a cancelled tool has to stop (calls.cancel_grace_ms), set by the runner
    phase: Phase = field(default=Phase.CHECKING, init=False)
    task: asyncio.Task[Any] | None = field(default=None, init=False)  # the one running the call
    sandbox: Sandbox | None = field(default=None, init=False)
    cancel_reason: str | None = field(default=None, init=False)
    queue_wait_s: float | None = field(default=None, init=False)  # set once a sandbox is acquired
    client_paused: bool = field(default=False, init=False)  # its client reads no more
    _sandbox_paused: bool = field(default=False, init=False, repr=False)  # so we stopped reading its sandbox
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

    def pause(self) -> None:
        """The client reads no more: stop reading the sandbox now if the tool runs, else at its first
        progress, so that its output waits in the sandbox."""
        self.client_paused = True
        self.progressed()

    def resume(self) -> None:
        self.client_paused = False
        self._resume_sandbox()

    def progressed(self) -> None:
        """A progress notification is on its way to the client: a paused client pauses the sandbox too."""
        if self.client_paused and not self._sandbox_paused and self.phase is Phase.RUNNING and self.sandbox is not None:
            self.sandbox.pause_reading()
            self._sandbox_paused = True

    def _resume_sandbox(self) -> None:
        if self._sandbox_paused and self.sandbox is not None:
            self._sandbox_paused = False
            self.sandbox.resume_reading()

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
        if self._sandbox_paused:  # resumed before it goes back to the pool: the next caller must find it reading
            self._resume_sandbox()


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
        self.storage: Storage | None = None  # the disk quota: refuses users over it, measures after calls

    async def run(self, call: CallParams, ctx: CallContext, on_progress: Callable[[list[Any]], None]) -> dict[str, Any]:
        """Acquire a sandbox → call its shim → release it. Every outcome is a result, but a sandbox
        that could not be had (a JSON-RPC error, raised); each is logged and counted once."""
        started = time.monotonic()
        ctx.task = asyncio.current_task()
        ctx.grace = self.config.calls.cancel_grace_ms / 1000
        try:
            # The call's secrets are masked in this task's log lines, and in its sandbox's (they go with the request).
            values = call.secrets()
            with secret_values(values) if values else _NO_SECRETS as masked:
                if ctx.cancel_reason is not None:  # cancelled before it got here
                    outcome = _not_started(ctx, started)
                else:
                    refused = self.storage.refusal(call.user) if self.storage is not None else None
                    if refused is not None:  # over quota (measured): no sandbox is taken for a call that would add more
                        raise refused
                    request, guard = self._request(call, masked)
                    ctx.enter_queue()
                    queued_at = time.monotonic()
                    pooled = await self.pool.acquire(call.user)
                    ctx.queue_wait_s = time.monotonic() - queued_at
                    reusable = False
                    try:
                        outcome, reusable = await self._in_sandbox(pooled.sandbox, request, guard, call, ctx, on_progress, started)
                    finally:
                        ctx.finish()
                        # Released just after the answer is written (the dispatcher sends it when this returns):
                        # the caller's path ends at the answer, the pool's bookkeeping need not sit on it.
                        asyncio.get_running_loop().call_soon(functools.partial(self.pool.release, pooled, reusable=reusable))
        except asyncio.CancelledError:
            if ctx.cancel_reason is None:
                raise  # the daemon itself is stopping the task
            outcome = _not_started(ctx, started)  # cancelled while it waited for a sandbox
        except Exception as exc:
            error = exc.message if isinstance(exc, SandboxdError) else None
            self._record(call, ctx, _ERROR_STATUS.get(type(exc), "internal_error"), time.monotonic() - started, error)
            raise
        if self.storage is not None and ctx.sandbox is not None:
            self.storage.after_call(call.user)
            if outcome["isError"] and _DISK_FULL.search(json.dumps(outcome["content"])):
                # Which quota the write hit, and how to free space; measured now, on failed calls only.
                note = await self.storage.note(call.user)
                if note is not None:
                    outcome["content"] = [*outcome["content"], *text(note)]
        # Logged and counted just after the answer is written, like the release.
        asyncio.get_running_loop().call_soon(self._record, call, ctx, outcome["status"], time.monotonic() - started)
        return outcome

    def _request(self, call: CallParams, secrets: frozenset[str]) -> tuple[CallRequest, CallGuard]:
        """What the shim is sent, and what the sandbox holds this call to."""
        # The sandbox holds stand-ins for egress.secrets, the egress proxy the values (egress/secrets.py).
        env, stand_ins = StandIns.for_call(call.env, self.config.egress.secrets)
        calls = self.config.calls
        request = CallRequest(
            tool_call_id=call.tool_call_id,
            entry=self.backend.entry_path(call.tool),
            arguments=call.arguments,
            env=env,
            max_result_bytes=calls.max_result_bytes,
            stand_ins=stand_ins,
            # Only a call whose env names the relay's port gets one (relay_for_call): most have no env.
            browser_relay=relay_for_call(self.config.integrations.relay, call.env) if call.env else None,
        )
        limits = OutputLimits(calls.output_rate_bytes, calls.output_burst_bytes, calls.idle_output_bytes)
        return request, CallGuard(output_limits=limits, tool=call.tool.name, secrets=secrets)

    async def _in_sandbox(self, sandbox: Sandbox | None, request: CallRequest, guard: CallGuard, call: CallParams,
                          ctx: CallContext, on_progress: Callable[[list[Any]], None],
                          started: float) -> tuple[dict[str, Any], bool]:
        """The call in its sandbox, from request to outcome; and whether the sandbox may serve another."""
        assert sandbox is not None  # the pool hands out started sandboxes only
        calls = self.config.calls
        progress = _ProgressBudget(calls.max_progress_updates, calls.max_progress_bytes, on_progress)
        future = progress.future = sandbox.call(request, progress, guard)
        ctx.start_running(sandbox, future, call.timeout_s)
        try:
            answer = await future
        except _Timeout:
            return result("timeout", text(
                f"The tool did not finish within {call.timeout_s:g} s and was stopped; "
                "its sandbox was replaced. Ask for less work per call or raise timeoutMs."), started), False
        except _GraceExpired:
            return result("cancelled", text(
                f"The call was cancelled ({ctx.cancel_reason}); the tool did not stop within "
                f"{ctx.grace:g} s, so its sandbox was killed and replaced."), started), False
        except _Killed as exc:
            return result("cancelled", text(exc.message), started), False
        except (SandboxFailed, _ProgressCapExceeded) as exc:
            return result("crashed", text(exc.message), started), False
        # The shim says when a tool left processes running or /tmp full (docs/shim.md).
        retire = answer.get("retire")
        if retire:
            log.info("sandbox_retired", user=call.user, tool=call.tool.name, sandbox=sandbox.id,
                     reason=str(retire)[:500], budget=source("user", call.user))
        content = answer.get("content")
        if not isinstance(content, list):
            content = text("The tool's sandbox returned a malformed result.")
        if ctx.cancel_reason is not None:
            return result("cancelled", content, started, is_error=True, details=answer.get("details")), not retire
        status = "ok" if answer.get("status") == "ok" and not answer.get("isError") else "error"
        return result(status, content, started, details=answer.get("details")), not retire

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
        # Built only when the user's log budget admits it: at a few thousand calls a second most are dropped.
        if admitted(source("user", call.user), "call"):
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
            )
        if self.on_call is not None:
            self.on_call(call.tool.name, status, duration_s, ctx.queue_wait_s)


class Calls:
    """Every tools/call on the daemon goes through here: admit → check → run → answer."""

    def __init__(self, runner: CallRunner, catalog: ToolCatalog, *, stopping: Callable[[], bool]) -> None:
        self.runner = runner
        self.catalog = catalog
        self._stopping = stopping
        self.in_flight: set[CallContext] = set()  # from their first step to their answer: what shutdown waits for

    def start(self, request_id: Any, params: Any, send: Callable[[dict[str, Any]], None]) -> Later:
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
        meta = params["_meta"] if isinstance(params.get("_meta"), dict) else {}
        ctx = CallContext()
        on_progress = _progress_notifier(ctx, meta.get("progressToken", request_id), send)
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
            return await self.runner.run(call, ctx, on_progress)
        finally:
            self.in_flight.discard(ctx)

    def _check(self, params: Any, arrived: float) -> CallParams:
        return parse_call_params(params, self.catalog, self.runner.config, since=arrived)


def _progress_notifier(ctx: CallContext, token: Any, send: Callable[[dict[str, Any]], None]) -> Callable[[list[Any]], None]:
    """A call's progress as notifications to its client, numbered from 1 (docs/protocol.md)."""
    numbers = itertools.count(1)

    def notify(content: list[Any]) -> None:
        ctx.progressed()
        send(notification("notifications/progress", {"progressToken": token, "progress": next(numbers), "content": content}))

    return notify
