"""A call in flight (``CallContext``): its phase, its deadline and cancel grace, the client's
back-pressure, and the progress it may send (``ProgressBudget``)."""

from __future__ import annotations

import asyncio
import enum
import json
from dataclasses import dataclass, field
from typing import Any, Callable

from sandboxd.sandbox.backend import Sandbox


class TimedOut(Exception):
    pass


class GraceExpired(Exception):
    pass


class Killed(Exception):
    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class ProgressCapExceeded(Exception):
    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class ProgressBudget:
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
            _fail(self.future, ProgressCapExceeded(
                f"The tool sent more than {self._max_updates} progress updates (calls.max_progress_updates); "
                "the call was stopped and its sandbox replaced. Report progress less often."))
        elif self._bytes > self._max_bytes:
            _fail(self.future, ProgressCapExceeded(
                f"The tool sent more than {self._max_bytes} bytes of progress (calls.max_progress_bytes); "
                "the call was stopped and its sandbox replaced. Send short progress messages; put data in the result."))
        else:
            self._forward(content)


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
    user: str | None = field(default=None, init=False)  # set once past the user's hold (calls/holds.py)
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
            self._timers.append(asyncio.get_running_loop().call_later(self.grace, _fail, self._future, GraceExpired()))

    def kill(self, message: str) -> bool:
        """End a running call now, answered ``cancelled`` with ``message``; its sandbox is replaced.
        False if no tool is running (nothing to kill)."""
        if self.phase is not Phase.RUNNING or self._future is None or self._future.done():
            return False
        self._future.set_exception(Killed(message))
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
        self._timers.append(future.get_loop().call_later(timeout_s, _time_out, future))

    def finish(self) -> None:
        self.phase = Phase.DONE
        for timer in self._timers:
            timer.cancel()
        if self._sandbox_paused:  # resumed before it goes back to the pool: the next caller must find it reading
            self._resume_sandbox()


def _fail(future: asyncio.Future[Any], exc: BaseException) -> None:
    if not future.done():
        future.set_exception(exc)


def _time_out(future: asyncio.Future[Any]) -> None:
    """The call's deadline passed. Its exception is made only now: few calls reach their deadline."""
    _fail(future, TimedOut())
