"""When a user's folders are walked: coalesced, at most one walk a second per user, whoever asks.

Every path that wants a user's usage (a call's end, a failed write's note, a refusal, the
periodic checks) asks for the user's next walk. Everyone who asks before it starts shares
it, and it starts no sooner than MIN_SPACING_S after that user's last one started, later
after a long walk (WALK_SHARE). So a tool failing with ENOSPC from many sandboxes at once
costs one walk a second, not one per call. Walks run in one worker thread, never on the loop.
"""

from __future__ import annotations

import asyncio
import os
import time
from concurrent.futures import Executor
from pathlib import Path
from typing import Callable, Generic, TypeVar

from sandboxd.errors import InvalidParams
from sandboxd.users import check_user

MIN_SPACING_S = 1.0  # between the starts of two walks of one user's folders
WALK_SHARE = 0.2  # one user's walks take at most this share of the walking thread's time

T = TypeVar("T")


class Walks(Generic[T]):
    """Schedules ``walk(user)`` in ``executor``; ``done(user, future)`` runs on the loop after each."""

    def __init__(self, executor: Executor, walk: Callable[[str], T],
                 done: Callable[[str, asyncio.Future[T]], None]) -> None:
        self._executor = executor
        self._walk = walk
        self._done = done
        self._next: dict[str, asyncio.Future[T]] = {}  # by user: the walk not yet started, shared by its askers
        self._last_start: dict[str, float] = {}
        self._last_took: dict[str, float] = {}
        self._running: set[str] = set()  # users whose walk waits for the thread or runs: one each at most

    def next(self, user: str) -> asyncio.Future[T]:
        """The result of ``user``'s next walk, shared with everyone who asked since their last one started."""
        future = self._next.get(user)
        if future is None:
            loop = asyncio.get_running_loop()
            future = self._next[user] = loop.create_future()
            last = self._last_start.get(user)
            wait = 0.0 if last is None else last + self.spacing(user) - time.monotonic()
            loop.call_later(max(0.0, wait), self._start, user)
        return future

    def spacing(self, user: str) -> float:
        return max(MIN_SPACING_S, self._last_took.get(user, 0.0) / WALK_SHARE)

    def _start(self, user: str) -> None:
        loop = asyncio.get_running_loop()
        if user in self._running:  # the thread is behind: never more than one walk of a user in its queue
            loop.call_later(MIN_SPACING_S, self._start, user)
            return
        future = self._next.pop(user)
        self._last_start[user] = time.monotonic()
        try:
            walking = loop.run_in_executor(self._executor, self._timed, user)
        except RuntimeError:  # the executor was shut down: the daemon is stopping
            future.cancel()
            return
        self._running.add(user)
        walking.add_done_callback(lambda walked: self._finish(user, walked, future))

    def _timed(self, user: str) -> T:
        started = time.monotonic()
        try:
            return self._walk(user)
        finally:
            self._last_took[user] = time.monotonic() - started

    def _finish(self, user: str, walked: asyncio.Future[T], future: asyncio.Future[T]) -> None:
        self._running.discard(user)
        if future.done():  # cancelled: the daemon is stopping
            pass
        elif walked.cancelled():
            future.cancel()
        elif walked.exception() is not None:
            future.set_exception(walked.exception())  # type: ignore[arg-type]
        else:
            future.set_result(walked.result())
        self._done(user, future)


def users_on_disk(data_path: Path) -> list[str]:
    """The users with a folder in ``data_path`` (blocking): those the interval's walks measure."""
    try:
        names = os.listdir(data_path)
    except OSError:
        return []
    users = []
    for name in names:
        try:
            if check_user(name) == name:
                users.append(name)
        except InvalidParams:
            continue
    return users
