"""Max-min fair service of the callers waiting for sandboxes (docs/design.md, "Sharing the pool").

Step 2 of ``Pool._plan``, as a function of what the plan has counted: it decides, turn by turn,
and says each decision through ``Actions``, which ``_plan`` supplies, so the pool's state still
changes in ``_plan`` alone. The rules:

Users take turns, the one holding fewest first (ties: one with an idle sandbox of its own, then
the one waiting longest), one caller a turn; a user's own callers are served first come, first
served. A turn is served by, cheapest first: the user's own idle sandbox; a start in free room;
room already on its way (a sandbox being destroyed); an idle sandbox of another user, evicted: a
spare of a user with nobody waiting (the longest idle), else one of the user holding most, if
that is more than this user holds (they give way at their release). A user's callers beyond
those their starting sandboxes will serve need a turn each. Calls beyond a user's first never
take the last ``pool.reserve`` slots (the ceiling). No running call is ever stopped.
"""

from __future__ import annotations

import collections
import heapq
from dataclasses import dataclass
from typing import Any, Callable, Iterable

from sandboxd.config import PoolConfig
from sandboxd.sandbox.pooled import HELD, PooledSandbox, Waiter


@dataclass(frozen=True, slots=True)
class Actions:
    """What a turn can decide; ``Pool._plan`` supplies each, and carries it out on the pool's state at once."""

    hand: Callable[[Waiter, PooledSandbox], None]  # give the waiter this idle sandbox of its user
    start: Callable[[str], None]  # start a sandbox for the user in free room
    evict: Callable[[PooledSandbox], None]  # destroy this idle sandbox of another user, to make room


@dataclass
class Counts:
    """The pool as the turns see it, counted by ``_plan`` before them; the turns keep it current."""

    held: dict[str, int]  # each waiting user's sandboxes busy or starting
    starting: dict[str, int]  # of those, starting: each will serve one caller
    owned: dict[str, int]  # each waiting user's sandboxes in any state (for max_per_user)
    total: int  # sandboxes in the pool, in any state (for max_total)
    held_total: int  # sandboxes held for calls, in all (for the ceiling)
    stopping: int  # sandboxes being destroyed: each frees a slot once the engine has removed it


def serve_fairly(queues: dict[str, collections.deque[Waiter]], idle_of: dict[str, list[PooledSandbox]],
                 arrival: dict[Waiter, int], counts: Counts, *, max_per_user: int, max_total: int, ceiling: int,
                 act: Actions) -> None:
    """Serve ``queues`` (each waiting user's callers, in arrival order) in fair turns, from
    ``idle_of`` (each user's idle sandboxes, in pool order; taken from as they are handed out or
    evicted). ``arrival``: each waiter's place in the pool's queue."""
    held, covered = counts.held, dict(counts.starting)
    claimed = dict.fromkeys(queues, 0)  # room on its way or evicted for them, in this plan

    def turn(user: str) -> tuple[int, int, int, str]:
        return held[user], 0 if idle_of.get(user) else 1, arrival[queues[user][0]], user

    heap = [turn(user) for user in queues]
    heapq.heapify(heap)
    while heap:
        user = heapq.heappop(heap)[-1]
        queue, idle = queues[user], idle_of.get(user)
        if held[user] and counts.held_total >= ceiling:
            continue  # the reserve is for first calls: this user waits for a release
        if idle:
            act.hand(queue.popleft(), idle.pop(0))
        elif len(queue) > covered[user]:
            if counts.owned[user] + claimed[user] >= max_per_user:
                continue  # at their own limit: their callers wait for their own releases
            if counts.total < max_total:
                act.start(user)
                counts.owned[user] += 1
                counts.total += 1
            elif counts.stopping:
                counts.stopping -= 1
                claimed[user] += 1
            else:
                victim = _victim(user, held, queues, idle_of)
                if victim is None:
                    continue  # nobody has anything to give up until a release
                idle_of[victim.user].remove(victim)
                act.evict(victim)
                claimed[user] += 1
            covered[user] += 1
        else:
            continue  # every caller of theirs is covered by a start
        held[user] += 1
        counts.held_total += 1
        if queue and (len(queue) > covered[user] or idle_of.get(user)):
            heapq.heappush(heap, turn(user))


def _victim(user: str, held: dict[str, int], queues: dict[str, collections.deque[Waiter]],
            idle_of: dict[str, list[PooledSandbox]]) -> PooledSandbox | None:
    """The idle sandbox of another user to evict for ``user``, or None: a spare of a user nobody
    of whom waits (the longest idle first), else one of a waiting user holding more than ``user``
    (the one holding most first)."""
    best: tuple[tuple[int, float], PooledSandbox] | None = None
    for owner, idle in idle_of.items():
        if owner == user or not idle:
            continue
        if owner not in queues:
            key = (0, min(p.since for p in idle))
        elif held[owner] > held[user]:
            key = (1, -held[owner])
        else:
            continue
        if best is None or key < best[0]:
            best = key, min(idle, key=lambda p: p.since)
    return best[1] if best is not None else None


def holdings(sandboxes: Iterable[PooledSandbox], waiters: Iterable[Waiter], config: PoolConfig) -> dict[str, Any]:
    """Who holds and waits for what (per user and in all: sandboxes by state, ``holding`` = busy or
    starting, ``waiting`` callers) and the sharing rules as they stand: the reserve, the users
    active, and the fair share max-min fairness gives each of them in a full pool."""
    keys = ("starting", "idle", "busy", "stopping", "waiting", "holding")
    users: dict[str, dict[str, int]] = {}
    for pooled in sandboxes:
        row = users.setdefault(pooled.user, dict.fromkeys(keys, 0))
        row[pooled.state.value] += 1
        if pooled.state in HELD:
            row["holding"] += 1
    for waiter in waiters:
        users.setdefault(waiter.user, dict.fromkeys(keys, 0))["waiting"] += 1
    totals = {key: sum(row[key] for row in users.values()) for key in keys}
    active = sum(1 for row in users.values() if row["holding"] or row["waiting"])
    sharing = {"reserve": config.reserved, "activeUsers": active,
               "fairShare": min(config.max_per_user, max(1, config.max_total // max(1, active)))}
    return {"totals": totals, "users": users, "sharing": sharing}
