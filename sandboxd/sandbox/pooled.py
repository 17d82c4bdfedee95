"""The pool's records: a sandbox as the pool sees it (``PooledSandbox``, its ``State`` and the
facts events record on it), a caller waiting for one (``Waiter``), and what a plan decided
(``Plan``). The pool (pool.py) changes them in one step; sharing.py reads them."""

from __future__ import annotations

import asyncio
import enum
from dataclasses import dataclass

from sandboxd.errors import SandboxdError
from sandboxd.sandbox.backend import Sandbox


class State(enum.Enum):
    STARTING = "starting"
    IDLE = "idle"
    BUSY = "busy"
    STOPPING = "stopping"  # being destroyed; still counts against the limits


# The states by plain names, for every call's path (acquire, release): looking a member up on
# its enum costs ~0.2 µs in Python 3.11, a module name a tenth of that.
STARTING, IDLE, BUSY, STOPPING = State.STARTING, State.IDLE, State.BUSY, State.STOPPING
# The states in which a sandbox is held for a call: busy, or starting for one (a spare's start counts too).
HELD = (BUSY, STARTING)


@dataclass(eq=False)
class PooledSandbox:
    user: str
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

    @property
    def id(self) -> str:
        return self.sandbox.id if self.sandbox is not None else "(starting)"


@dataclass(eq=False)
class Waiter:
    user: str
    future: asyncio.Future[PooledSandbox]


class Plan:
    """What a plan decided for ``_apply`` to do (a plain class: one is made twice per call)."""

    __slots__ = ("start", "destroy", "handed")

    def __init__(self) -> None:
        self.start: list[PooledSandbox] = []
        self.destroy: list[PooledSandbox] = []
        self.handed: PooledSandbox | None = None  # what the arriving caller of a one-user plan took
