"""The pool's records: a sandbox as the pool sees it (``PooledSandbox``, its ``State`` and the
facts events record on it), a caller waiting for one (``Waiter``), and what a plan decided
(``Plan``). The pool (pool.py) decides from them in one function and changes them in one
place; sharing.py reads them."""

from __future__ import annotations

import asyncio
import enum
from dataclasses import dataclass, field

from sandboxd.errors import SandboxdError
from sandboxd.sandbox.backend import Sandbox
from sandboxd.sandbox.email_access import owner_user


class State(enum.Enum):
    STARTING = "starting"
    IDLE = "idle"
    BUSY = "busy"
    STOPPING = "stopping"  # being destroyed; still counts against the limits


# The states by plain names: every call's path (acquire, release) reads them, and an enum lookup is slower.
STARTING, IDLE, BUSY, STOPPING = State.STARTING, State.IDLE, State.BUSY, State.STOPPING
# The states in which a sandbox is held for a call: busy, or starting for one (a spare's start counts too).
HELD = (BUSY, STARTING)


@dataclass(eq=False)
class PooledSandbox:
    user: str  # its owner: the user and the email access it carries (sandbox/email_access.py)
    state: State
    sandbox: Sandbox | None = None
    calls: int = 0
    since: float = 0.0  # when it entered its current state
    generation: int = 0  # the sandbox settings it was started with (see Pool.retire_all)
    # What happened to it, recorded by the event that saw it; the next _plan acts on it (its start
    # finished: ``sandbox`` is set).
    call_ended: bool = False  # release: its call is over
    spent: bool = False  # release: that call left it unfit for another (crashed, killed, old settings, max calls)
    start_error: SandboxdError | None = None  # its start failed
    removed: bool = False  # the backend has removed it (or gave up and listed it for removal)
    # The user alone, whatever the access: the limits and the fair share count their sandboxes together.
    account: str = field(init=False)

    def __post_init__(self) -> None:
        self.account = owner_user(self.user)

    @property
    def alive(self) -> bool:
        return self.sandbox is not None and self.sandbox.alive

    @property
    def current(self) -> State:
        """Its state once a call's end is settled: a released sandbox waits in BUSY for the next plan
        (``Pool.release`` plans only when someone waits or it is spent), idle to anyone who asks."""
        return IDLE if self.call_ended else self.state

    @property
    def held_now(self) -> bool:
        """Busy or starting once its recorded events are settled (cases 1 and 2 of ``Pool._plan``)."""
        if self.state is BUSY:
            return not self.call_ended
        return self.state is STARTING and self.sandbox is None and self.start_error is None

    @property
    def id(self) -> str:
        return self.sandbox.id if self.sandbox is not None else "(starting)"


@dataclass(eq=False)
class Waiter:
    user: str
    future: asyncio.Future[PooledSandbox]


def gone(pooled: PooledSandbox, state: State, plan: Plan) -> bool:
    """Case 2 of ``Pool._plan``: removed by the backend, or its start failed: no longer the pool's."""
    if state is STOPPING and pooled.removed:
        plan.forget.append(pooled)
        return True
    if state is STARTING and pooled.start_error is not None:
        plan.failed.append(pooled)
        return True
    return False


class Plan:
    """What ``Pool._plan`` decided, by its numbered cases, for the pool to apply: first to its
    state (``Pool._commit``, in one place), then by I/O (``Pool._act``). A plain class with
    slots: two are made per call."""

    __slots__ = ("now", "ready", "forget", "failed", "destroy", "quiet", "drop", "fail", "hand", "start")

    def __init__(self, now: float) -> None:
        self.now = now
        self.ready: list[PooledSandbox] = []  # 1. its call or its start ended: idle from now
        self.forget: list[PooledSandbox] = []  # 2. removed by the backend
        self.failed: list[PooledSandbox] = []  # 2. its start failed: forgotten, its user backs off
        self.destroy: list[PooledSandbox] = []  # 3. and 6. idle ones, to destroy
        self.quiet: list[str] = []  # 4. users quiet past the TTL, with nothing left
        self.drop: list[Waiter] = []  # 5. callers whose wait ended (their future is done)
        self.fail: list[tuple[Waiter, SandboxdError]] = []  # 2. callers of a user whose start failed, and why
        self.hand: list[tuple[Waiter, PooledSandbox]] = []  # 6. who gets which idle sandbox
        self.start: list[str] = []  # 6. and 7. a user per sandbox to start

    def __bool__(self) -> bool:
        """Anything to do (an empty plan is the common one while nothing changes)."""
        return bool(self.ready or self.forget or self.failed or self.destroy or self.quiet or self.drop
                    or self.fail or self.hand or self.start)
