"""Users whose calls are held: new calls wait, and the hold begins once the calls already running have ended.

An export that reads a user's folder live (no btrfs snapshot: storage/transfer/export.py)
holds the user for its whole stream, so no tool writes the folder under it. A held call
waits in its ``checking`` phase, cancellable like any other; its deadline keeps running.
"""

from __future__ import annotations

import asyncio
import time
from contextlib import asynccontextmanager
from typing import AsyncIterator, Callable, Iterable, Protocol

POLL_S = 0.02  # how often a hold looks whether the user's running calls have ended


class HeldCall(Protocol):
    user: str | None  # set once the call is past its user's hold


class CallsStillRunning(Exception):
    """The user's calls did not end within the hold's wait."""


class UserHolds:
    def __init__(self, in_flight: Callable[[], Iterable[HeldCall]]) -> None:
        self._in_flight = in_flight
        self.held: dict[str, asyncio.Event] = {}  # user → set when their hold ends

    async def wait(self, user: str) -> None:
        """Return once ``user`` is not held (at once when they are not)."""
        while (released := self.held.get(user)) is not None:
            await released.wait()

    @asynccontextmanager
    async def hold(self, user: str, *, wait_s: float) -> AsyncIterator[None]:
        """Hold ``user``'s new calls, wait (up to ``wait_s``) for their running ones to end; release at exit.

        CallsStillRunning when some are still running after ``wait_s`` (the hold is released then)."""
        await self.wait(user)  # one hold at a time per user
        released = self.held[user] = asyncio.Event()
        try:
            deadline = time.monotonic() + wait_s
            while any(call.user == user for call in self._in_flight()):
                if time.monotonic() >= deadline:
                    raise CallsStillRunning(f"{user}'s calls still ran after {wait_s:g} s")
                await asyncio.sleep(POLL_S)
            yield
        finally:
            del self.held[user]
            released.set()
