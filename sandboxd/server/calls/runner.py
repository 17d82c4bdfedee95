"""``CallRunner.run``: admit → in the sandbox (acquire it from pool.py, call its shim, release it) →
after; every outcome a result, counted and logged once. ``sandboxd run`` runs its calls through it too."""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import time
from collections import defaultdict
from typing import TYPE_CHECKING, AbstractSet, Any, Callable, Protocol

from sandboxd.config import CallsConfig, Config
from sandboxd.errors import (BackendUnavailable, NotServedHere, Overloaded, QuotaExceeded, SandboxdError, SandboxFailed,
                             ShuttingDown)
from sandboxd.logging import admitted, get_logger, secret_values, source
from sandboxd.rules.browser_relay import relay_for_call
from sandboxd.rules.secrets import NO_STAND_INS, StandIns
from sandboxd.sandbox.backend import Backend, CallGuard, CallRequest, OutputLimits
from sandboxd.sandbox.pool import Pool
from sandboxd.server.calls.context import (CallContext, GraceExpired, Killed, ProgressBudget, ProgressCapExceeded,
                                          TimedOut)
from sandboxd.server.calls.params import CallParams

if TYPE_CHECKING:
    from sandboxd.storage.quota import Storage

log = get_logger("sandboxd.calls")


# How a call that ends in a JSON-RPC error (not a result) is counted and logged.
_ERROR_STATUS: dict[type[Exception], str] = {Overloaded: "overloaded", BackendUnavailable: "unavailable", ShuttingDown: "shutting_down",
                                             QuotaExceeded: "over_quota", NotServedHere: "not_served"}
# A call without env or sensitive arguments registers nothing to mask in its log lines.
_NO_SECRETS: contextlib.nullcontext[frozenset[str]] = contextlib.nullcontext(frozenset())
# What a tool's error says when a write failed on a full disk or quota (Node's and libc's wording).
_DISK_FULL = re.compile(r"EDQUOT|ENOSPC|[Dd]isk quota exceeded|[Nn]o space left on device")


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


class CallGate(Protocol):
    """Whether this host serves a user now (server/cluster_host.py: the cluster's directory)."""

    def admit(self, user: str) -> int | None:
        """The user's epoch to serve them at; None: claim them first; raises NotServedHere to refuse."""

    async def claim(self, user: str) -> int: ...

    def served(self, user: str, epoch: int, start: float) -> None:
        """A call of ``user`` ran here from ``start`` (wall clock) until now."""


class CallRunner:
    """Runs checked calls. ``storage``: the disk quota (refuses users over it, measures after calls);
    ``on_call``: told (tool, status, duration_s, queue_wait_s) as each call ends (the metrics);
    ``gate``: with ``cluster:``, whether this host serves the user (asked before a sandbox is taken)."""

    def __init__(self, config: Config, pool: Pool, backend: Backend, *, storage: Storage | None = None,
                 on_call: Callable[[str, str, float, float | None], None] | None = None,
                 gate: CallGate | None = None) -> None:
        self.config = config
        self.pool = pool
        self.backend = backend
        self.storage = storage
        # The storage's own set, changed in place: a call asks it before it asks for a refusal.
        self._over_quota: AbstractSet[str] = storage.over_quota if storage is not None else frozenset()
        self.on_call = on_call
        self.gate = gate
        self.counts: defaultdict[str, int] = defaultdict(int)  # calls by status
        # The sandbox's output budget, as calls.* (of the section it was made from) sets it.
        self._limits_of: CallsConfig | None = None
        self._limits = OutputLimits()

    async def run(self, call: CallParams, ctx: CallContext, on_progress: Callable[[list[Any]], None]) -> dict[str, Any]:
        """A call in three steps. Every outcome is a result, but a sandbox that could not be had
        (a JSON-RPC error, raised); each is logged and counted once.

        1. Admit: a call cancelled before it got here is answered at once; a user another host serves
           (``cluster:``) or measured over quota is refused, so no sandbox is taken for the call.
        2. In the sandbox: wait for one, check the quota again, call its shim, release the sandbox.
        3. After: the user's folders measured, and a write that failed on a full disk told which
           quota it hit; the call logged and counted just after its answer is written.

        The quota's part of step 1 opens ``_in_sandbox``: the warm path makes no call of its own for it.
        """
        started = time.monotonic()
        # Looked up once: each lookup of the running loop costs a getpid() system call in Python 3.11.
        loop = asyncio.get_running_loop()
        ctx.task = asyncio.current_task(loop)
        ctx.grace = self.config.calls.cancel_grace_ms / 1000
        try:
            # The call's secrets are masked in this task's log lines, and in its sandbox's (they go with the request).
            values = call.secrets()
            with secret_values(values) if values else _NO_SECRETS as masked:
                if ctx.cancel_reason is not None:  # 1: cancelled before it got here
                    outcome = _not_started(ctx, started)
                elif self.gate is None:
                    outcome = await self._in_sandbox(call, ctx, masked, on_progress, started, loop)  # 1, 2
                else:  # 1: with cluster:, a user another host serves is refused before a sandbox is taken
                    outcome = await self._gated(self.gate, call, ctx, masked, on_progress, started, loop)
        except asyncio.CancelledError:
            if ctx.cancel_reason is None:
                raise  # the daemon itself is stopping the task
            outcome = _not_started(ctx, started)  # cancelled while it waited for a sandbox
        except Exception as exc:
            error = exc.message if isinstance(exc, SandboxdError) else None
            self._record(call, ctx, _ERROR_STATUS.get(type(exc), "internal_error"), time.monotonic() - started, error)
            raise
        if self.storage is not None and ctx.sandbox is not None:  # 3
            self.storage.after_call(call.user)
            if outcome["isError"] and _DISK_FULL.search(json.dumps(outcome["content"])):
                await self._note_disk(self.storage, call.user, outcome)
        # Logged and counted just after the answer is written, like the release.
        loop.call_soon(self._record, call, ctx, outcome["status"], time.monotonic() - started)
        return outcome

    async def _gated(self, gate: CallGate, call: CallParams, ctx: CallContext, secrets: frozenset[str],
                     on_progress: Callable[[list[Any]], None], started: float,
                     loop: asyncio.AbstractEventLoop) -> dict[str, Any]:
        """``_in_sandbox`` for a user this host serves (the gate asked first, from its local view), logged with
        the user's epoch as the per-host call log."""
        epoch = gate.admit(call.user)
        if epoch is None:  # a user with no home yet: this host claims them, or learns who did
            epoch = await gate.claim(call.user)
        start = time.time()
        try:
            return await self._in_sandbox(call, ctx, secrets, on_progress, started, loop)
        finally:
            gate.served(call.user, epoch, start)

    async def _in_sandbox(self, call: CallParams, ctx: CallContext, secrets: frozenset[str],
                          on_progress: Callable[[list[Any]], None], started: float,
                          loop: asyncio.AbstractEventLoop) -> dict[str, Any]:
        """Steps 1 (the quota) and 2 of ``run``: a sandbox of the user's, the quota checked again, the call in
        it from request to outcome. The sandbox is released after, to serve another call unless this one left it spent."""
        over_quota = self._over_quota
        if call.user in over_quota:  # 1: over quota (measured)
            self._refuse(call.user)
        request, guard, owner = self._request(call, secrets)
        ctx.enter_queue()
        queued_at = time.monotonic()
        pooled = await self.pool.acquire(owner)  # 2
        ctx.queue_wait_s = time.monotonic() - queued_at
        reusable = True  # a sandbox the quota check refuses ran nothing
        try:
            if call.user in over_quota:  # measured over quota while it waited: its tool would write more
                self._refuse(call.user)
            reusable = False  # until the shim's answer says so
            sandbox = pooled.sandbox
            assert sandbox is not None  # the pool hands out started sandboxes only
            calls = self.config.calls
            progress = ProgressBudget(calls.max_progress_updates, calls.max_progress_bytes, on_progress)
            future = progress.future = sandbox.call(request, progress, guard)
            ctx.start_running(sandbox, future, call.timeout_s)
            try:
                answer = await future
            except (TimedOut, GraceExpired, Killed, SandboxFailed, ProgressCapExceeded) as exc:
                return self._stopped(exc, call, ctx, started)
            # The shim says when a tool left processes running or /tmp full (docs/shim.md).
            retire = answer.get("retire")
            if retire:
                log.info("sandbox_retired", user=call.user, tool=call.tool.name, sandbox=sandbox.id,
                         reason=str(retire)[:500], budget=source("user", call.user))
            reusable = not retire
            content = answer.get("content")
            if not isinstance(content, list):
                content = text("The tool's sandbox returned a malformed result.")
            if ctx.cancel_reason is not None:
                return result("cancelled", content, started, is_error=True, details=answer.get("details"))
            status = "ok" if answer.get("status") == "ok" and not answer.get("isError") else "error"
            return result(status, content, started, details=answer.get("details"))
        finally:
            ctx.finish()
            # Released just after the answer is written (the dispatcher sends it when run returns):
            # the caller's path ends at the answer, the pool's bookkeeping need not sit on it.
            loop.call_soon(self.pool.release, pooled, reusable)

    def _refuse(self, user: str) -> None:
        """Raise the quota's refusal for ``user``, unless their figures fell back under it meanwhile."""
        refused = self.storage.refusal(user) if self.storage is not None else None
        if refused is not None:
            raise refused

    async def _note_disk(self, storage: Storage, user: str, outcome: dict[str, Any]) -> None:
        """Which quota a failed write hit, and how to free space; measured now, on such calls only."""
        note = await storage.note(user)
        if note is not None:
            outcome["content"] = [*outcome["content"], *text(note)]

    def _request(self, call: CallParams, secrets: frozenset[str]) -> tuple[CallRequest, CallGuard, str]:
        """What the shim is sent, what the sandbox holds this call to, and the pool's owner whose sandbox runs it."""
        config = self.config
        tool = call.tool
        # What the tool's permissions give its calls, worked out once per tool (tools/permissions.py, ToolAccess).
        access = tool.accesses[config.tools.require_permissions]
        # Names the tool does not declare are dropped, never refused: pi-bridge sends one env with every call.
        env_in = access.call_env(call.env) if call.env else call.env
        if env_in:
            # The sandbox holds stand-ins for egress.secrets, the egress proxy the values (rules/secrets.py).
            env, stand_ins = StandIns.for_call(env_in, config.egress.secrets)
            # Only a call whose env names the relay's port gets one (relay_for_call), and only for browser: true.
            relay = relay_for_call(config.integrations.relay, env_in) if access.relay else None
        else:  # most calls
            env, stand_ins, relay = {}, NO_STAND_INS, None
        calls = config.calls
        if calls is not self._limits_of:  # made once per configuration: a reload brings a new calls section
            self._limits_of = calls
            self._limits = OutputLimits(calls.output_rate_bytes, calls.output_burst_bytes, calls.idle_output_bytes)
        # Positional: half the cost of keywords, and the names passed say which field is which.
        request = CallRequest(call.tool_call_id, self.backend.entry_path(tool), call.arguments, env,
                              calls.max_result_bytes, stand_ins, relay)
        # A sandbox carrying the tool's email access, and no other (sandbox/email_access.py).
        return request, CallGuard(self._limits, tool.name, secrets, access.network), call.user + access.owner_suffix

    def _stopped(self, exc: TimedOut | GraceExpired | Killed | SandboxFailed | ProgressCapExceeded, call: CallParams,
                 ctx: CallContext, started: float) -> dict[str, Any]:
        """The outcome of a call its sandbox did not answer; the sandbox is replaced."""
        if isinstance(exc, TimedOut):
            return result("timeout", text(
                f"The tool did not finish within {call.timeout_s:g} s and was stopped; "
                "its sandbox was replaced. Ask for less work per call or raise timeoutMs."), started)
        if isinstance(exc, GraceExpired):
            return result("cancelled", text(
                f"The call was cancelled ({ctx.cancel_reason}); the tool did not stop within "
                f"{ctx.grace:g} s, so its sandbox was killed and replaced."), started)
        return result("cancelled" if isinstance(exc, Killed) else "crashed", text(exc.message), started)

    def count_refused(self, params: Any, exc: SandboxdError) -> None:
        """A call refused before its params were read (the daemon stopping): counted and logged like the rest.

        Not in the metrics: they stop being served when shutdown begins, before any such refusal.
        """
        status = _ERROR_STATUS.get(type(exc), "internal_error")
        self.counts[status] += 1
        name = params.get("name") if isinstance(params, dict) else None
        log.info("call", tool=name[:200] if isinstance(name, str) else None, status=status, error=exc.message,
                 budget=source("calls", "refused while stopping"))

    def _record(self, call: CallParams, ctx: CallContext, status: str, duration_s: float, error: str | None = None) -> None:
        """The one log event per call, and its counters. No arguments or env: only who, what and how it went."""
        self.counts[status] += 1
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
