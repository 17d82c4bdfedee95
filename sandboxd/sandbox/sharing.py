"""Max-min fair service of the callers waiting for sandboxes (docs/design.md, "Sharing the pool").

Case 6 of ``Pool._plan``, as a pure function of what the plan has counted: ``serve_fairly``
returns its decisions (``Hand``, ``Start``, ``Evict``), in the order it took them, and changes
nothing it is given; the pool applies them to its state. The rules:

Users take turns, the one holding fewest first (ties: one with an idle sandbox of its own, then
the one waiting longest), one caller a turn; a user's own callers are served first come, first
served. A turn is served by, cheapest first: the user's own idle sandbox; a start in free room;
room already on its way (a sandbox being destroyed); an idle sandbox of another user, evicted: a
spare of a user with nobody waiting (the longest idle), else one of the user holding most, if
that is more than this user holds (they give way at their release). A user's callers beyond
those their starting sandboxes will serve need a turn each. Calls beyond a user's first never
take the last ``pool.reserve`` slots (the ceiling). No running call is ever stopped.

Callers wait per owner (a user and an email access), but what a user holds and owns counts their
sandboxes of every access together. A user at max_per_user whose caller needs another access
replaces their idle sandbox of an access nobody of theirs waits for (``Replace``).
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping, Sequence

from sandboxd.config import PoolConfig
from sandboxd.sandbox.email_access import owner_user
from sandboxd.sandbox.pooled import HELD, STOPPING, PooledSandbox, Waiter


@dataclass(frozen=True, slots=True)
class Hand:
    """Give ``waiter`` this idle sandbox of its user."""

    waiter: Waiter
    sandbox: PooledSandbox


@dataclass(frozen=True, slots=True)
class Start:
    """Start a sandbox for ``user`` in free room (it will serve one of their callers)."""

    user: str


@dataclass(frozen=True, slots=True)
class Evict:
    """Destroy this idle sandbox of another user, to make room for ``user``."""

    sandbox: PooledSandbox
    user: str


@dataclass(frozen=True, slots=True)
class Replace:
    """Destroy this idle sandbox of ``user``'s account, of another email access, and start one for ``user``
    in its place: the account is at max_per_user and nobody waits for that one."""

    sandbox: PooledSandbox
    user: str


Decision = Hand | Start | Evict | Replace


@dataclass(slots=True)
class Counts:
    """The pool as the turns see it, counted by the plan before them (a key missing counts 0). A user's
    sandboxes of every email access count together (their account), except where an owner's matters."""

    held: dict[str, int]  # each account's sandboxes busy or starting (the fair share, the reserve)
    starting: dict[str, int]  # each owner's starting: each will serve one caller of that access
    owned: dict[str, int]  # each account's sandboxes in any state (for max_per_user)
    total: int  # sandboxes in the pool, in any state (for max_total)
    held_total: int  # sandboxes held for calls, in all (for the ceiling)
    stopping: int  # sandboxes being destroyed: each frees a slot once the engine has removed it
    warming: dict[str, int] = field(default_factory=dict)  # each account's starting (min_idle)
    leaving: dict[str, int] = field(default_factory=dict)  # each account's stopping

    def hold(self, account: str, starting: str | None = None) -> None:
        """Count a sandbox of ``account``'s held for a call: busy, or starting (for its owner ``starting``)."""
        bump(self.held, account)
        self.held_total += 1
        if starting is not None:
            bump(self.starting, starting)
            bump(self.warming, account)

    def stop(self, account: str) -> None:
        """Count a sandbox of ``account``'s being destroyed."""
        self.stopping += 1
        bump(self.leaving, account)

    def hold_others(self, account: str, sandboxes: Iterable[PooledSandbox]) -> None:
        """Count everyone else's held and stopping sandboxes (for a plan of ``account`` alone near the ceiling)."""
        for pooled in sandboxes:
            if pooled.account == account:
                continue
            if pooled.state is STOPPING and not pooled.removed:
                self.stopping += 1
            elif pooled.held_now:
                self.held_total += 1

    def started(self, owner: str) -> str:
        """Count a start decided for ``owner``; returns ``owner``."""
        account = owner_user(owner)
        bump(self.owned, account)
        bump(self.warming, account)
        bump(self.starting, owner)
        self.total += 1
        return owner


def bump(counts: dict[str, int], user: str) -> None:
    counts[user] = counts.get(user, 0) + 1


@dataclass(frozen=True, slots=True)
class Limits:
    max_per_user: int
    max_total: int
    ceiling: int  # max_total less the reserve: calls beyond a user's first stop here


class _Turns:
    """The turns' own copy of what they change (the waiting users' counts, the idle sandboxes),
    kept current as they decide. Queues and idle sandboxes are an owner's (a user and an email
    access); the counts that limit and share are the account's (the user's, of every access)."""

    __slots__ = ("queues", "idle_of", "arrival", "counts", "limits", "served", "covered", "claimed", "account",
                 "siblings")

    def __init__(self, queues: Mapping[str, Sequence[Waiter]], idle_of: Mapping[str, Sequence[PooledSandbox]],
                 arrival: Mapping[Waiter, int], counts: Counts, limits: Limits) -> None:
        self.queues, self.arrival, self.limits = queues, arrival, limits
        self.idle_of = {user: list(idle) for user, idle in idle_of.items() if idle}
        self.account = {user: owner_user(user) for user in queues}
        accounts = set(self.account.values())
        self.counts = Counts({a: counts.held.get(a, 0) for a in accounts}, {},
                             {a: counts.owned.get(a, 0) for a in accounts},
                             counts.total, counts.held_total, counts.stopping,
                             leaving={a: counts.leaving.get(a, 0) for a in accounts})
        self.served = dict.fromkeys(queues, 0)  # callers handed a sandbox, per owner
        self.covered = {user: counts.starting.get(user, 0) for user in queues}  # callers a start or claimed room will serve
        self.claimed = dict.fromkeys(accounts, 0)  # room on its way or evicted for them
        # The waiting accounts' owners with idle sandboxes: what a user at their limit may replace.
        self.siblings: dict[str, list[str]] = {}
        for owner in self.idle_of:
            if owner_user(owner) in accounts:
                self.siblings.setdefault(owner_user(owner), []).append(owner)

    def key(self, user: str) -> tuple[int, int, int, str]:
        """Whose turn: fewest held, then one with an idle sandbox of its own, then the longest waiting."""
        first = self.queues[user][self.served[user]]
        return self.counts.held[self.account[user]], 0 if self.idle_of.get(user) else 1, self.arrival.get(first, 0), user

    def left(self, user: str) -> int:
        return len(self.queues[user]) - self.served[user]

    def another(self, user: str) -> bool:
        """``user`` needs another turn: a caller left that no start covers, or an idle sandbox to hand."""
        return bool(self.left(user) and (self.left(user) > self.covered[user] or self.idle_of.get(user)))

    def take(self, user: str) -> Decision | bool:
        """One turn of ``user``: a decision, True (room on its way claimed), or False (they wait)."""
        counts, account = self.counts, self.account[user]
        if held_back(counts.held[account], counts.held_total, self.limits.ceiling):
            return False  # the reserve is for first calls: this user waits for a release
        idle = self.idle_of.get(user)
        if idle:
            waiter = self.queues[user][self.served[user]]
            self.served[user] += 1
            return Hand(waiter, idle.pop(0))
        if self.left(user) <= self.covered[user]:
            return False  # every caller of theirs left is covered by a start
        if counts.owned[account] + self.claimed[account] >= self.limits.max_per_user:
            made = self.replace(user, account)  # at their own limit: else their callers wait for their own releases
        else:
            made = self.room(user)
        if made is not False:
            self.covered[user] += 1
        return made

    def room(self, user: str) -> Decision | bool:
        """Room for one more of ``user``'s sandboxes: a start, room on its way, or an eviction."""
        counts, account = self.counts, self.account[user]
        if counts.total < self.limits.max_total:
            return Start(counts.started(user))
        self.claimed[account] += 1
        if counts.stopping:
            counts.stopping -= 1
            return True
        victim = _victim(user, counts.held, self.queues, self.idle_of)
        if victim is None:
            self.claimed[account] -= 1
            return False  # nobody has anything to give up until a release
        self.idle_of[victim.user].remove(victim)
        return Evict(victim, user)

    def replace(self, user: str, account: str) -> Decision | bool:
        """``user``'s account is at max_per_user: its idle sandbox of another access that no caller waits
        for gives way (the longest idle), once none of theirs is still being destroyed (so at most one is
        beyond the limit). A full pool starts the new one once the engine has removed the old."""
        if self.counts.leaving.get(account):
            return False
        idle = [pooled for owner in self.siblings.get(account, ()) if owner != user and not self.waits(owner)
                for pooled in self.idle_of.get(owner, ())]
        if not idle:
            return False
        victim = min(idle, key=lambda pooled: pooled.since)
        self.idle_of[victim.user].remove(victim)
        bump(self.counts.leaving, account)
        if self.counts.total < self.limits.max_total:
            return Replace(victim, self.counts.started(user))
        self.claimed[account] += 1
        return Evict(victim, user)

    def waits(self, user: str) -> bool:
        return user in self.queues and self.left(user) > 0


def held_back(held: int, held_total: int, ceiling: int) -> bool:
    """The reserve: a user already holding ``held`` sandboxes waits while the pool holds its ceiling."""
    return held > 0 and held_total >= ceiling


def serve_fairly(queues: Mapping[str, Sequence[Waiter]], idle_of: Mapping[str, Sequence[PooledSandbox]],
                 arrival: Mapping[Waiter, int], counts: Counts, limits: Limits) -> list[Decision]:
    """The decisions that serve ``queues`` (each waiting user's callers, in arrival order) in fair
    turns, from ``idle_of`` (each user's idle sandboxes, in pool order). ``arrival``: each waiter's
    place in the pool's queue (needed only when more than one user waits). Nothing given is
    changed: the turns count on copies."""
    turns = _Turns(queues, idle_of, arrival, counts, limits)
    decisions: list[Decision] = []
    heap = [turns.key(user) for user in queues if queues[user]]
    heapq.heapify(heap)
    while heap:
        user = heapq.heappop(heap)[-1]
        made = turns.take(user)
        if made is False:
            continue
        if made is not True:
            decisions.append(made)
        bump(turns.counts.held, turns.account[user])
        turns.counts.held_total += 1
        if turns.another(user):
            heapq.heappush(heap, turns.key(user))
    return decisions


def _victim(user: str, held: Mapping[str, int], queues: Mapping[str, Sequence[Waiter]],
            idle_of: Mapping[str, Sequence[PooledSandbox]]) -> PooledSandbox | None:
    """The idle sandbox of another owner to evict for ``user``, or None: a spare of an owner nobody
    of whom waits (the longest idle first; the user's own of another access too), else one of a waiting
    user whose account holds more than ``user``'s (the one holding most first)."""
    best: tuple[tuple[int, float], PooledSandbox] | None = None
    mine = held.get(owner_user(user), 0)
    for owner, idle in idle_of.items():
        if owner == user or not idle:
            continue
        if owner not in queues:
            key = (0, min(p.since for p in idle))
        elif (theirs := held.get(owner_user(owner), 0)) > mine:
            key = (1, -theirs)
        else:
            continue
        if best is None or key < best[0]:
            best = key, min(idle, key=lambda p: p.since)
    return best[1] if best is not None else None


# Why a caller's wait for a sandbox ran out (sandboxd_pool_refusals_total{reason}).
REFUSAL_REASONS = ("user_limit", "reserve", "pool_full")


def refusal(user: str, theirs: Sequence[PooledSandbox], everyone: Iterable[PooledSandbox],
            config: PoolConfig) -> tuple[str, str]:
    """Which rule kept ``user`` waiting (one of REFUSAL_REASONS), and in words that say what to do;
    from ``theirs`` and ``everyone``'s sandboxes (a walk of the pool: only on a refusal)."""
    owned, running = len(theirs), sum(1 for pooled in theirs if pooled.current in HELD)
    held_total = sum(1 for pooled in everyone if pooled.current in HELD)
    if owned >= config.max_per_user:
        return "user_limit", (f"{user} already holds {owned} sandboxes, the most one user may "
                              f"(pool.max_per_user: {config.max_per_user}); make fewer calls at once")
    if running and held_total >= config.max_total - config.reserved:
        return "reserve", (f"{user} already runs {running} calls, and the last {config.reserved} of the pool's "
                           f"{config.max_total} sandboxes are kept for users' first calls (pool.reserve)")
    return "pool_full", f"all {config.max_total} sandboxes are in use by other users (pool.max_total)"


def holdings(sandboxes: Iterable[PooledSandbox], waiters: Iterable[Waiter], config: PoolConfig) -> dict[str, Any]:
    """Who holds and waits for what (per user and in all: sandboxes by state, ``holding`` = busy or
    starting, ``waiting`` callers) and the sharing rules as they stand: the reserve, the users
    active, and the fair share max-min fairness gives each of them in a full pool."""
    keys = ("starting", "idle", "busy", "stopping", "waiting", "holding")
    users: dict[str, dict[str, int]] = {}
    for pooled in sandboxes:  # a user's sandboxes of every email access in one row
        row = users.setdefault(owner_user(pooled.user), dict.fromkeys(keys, 0))
        state = pooled.current
        row[state.value] += 1
        if state in HELD:
            row["holding"] += 1
    for waiter in waiters:
        users.setdefault(owner_user(waiter.user), dict.fromkeys(keys, 0))["waiting"] += 1
    totals = {key: sum(row[key] for row in users.values()) for key in keys}
    active = sum(1 for row in users.values() if row["holding"] or row["waiting"])
    sharing = {"reserve": config.reserved, "activeUsers": active,
               "fairShare": min(config.max_per_user, max(1, config.max_total // max(1, active)))}
    return {"totals": totals, "users": users, "sharing": sharing}
