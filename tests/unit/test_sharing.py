"""sharing.serve_fairly on its own: the decisions it returns, from counts, with no pool around it
(the pool's own tests, test_pool.py, cover the same rules through acquire and release)."""

from __future__ import annotations

import asyncio
from typing import Any

from sandboxd.sandbox.pooled import PooledSandbox, State, Waiter
from sandboxd.sandbox.sharing import Counts, Decision, Evict, Hand, Limits, Start, serve_fairly


def said(decision: Decision) -> tuple[str, str]:
    """A decision in words: who gets what."""
    if isinstance(decision, Hand):
        return "hand", f"{decision.waiter.user}<-{decision.sandbox.user}"
    if isinstance(decision, Start):
        return "start", decision.user
    return "evict", decision.sandbox.user


def serve(waiting: dict[str, int], *, held: dict[str, int] | None = None, idle: dict[str, list[float]] | None = None,
          owned: dict[str, int] | None = None, starting: dict[str, int] | None = None, total: int = 0,
          held_total: int | None = None, stopping: int = 0, max_per_user: int = 4, max_total: int = 8,
          reserve: int = 0) -> list[tuple[str, str]]:
    """``waiting``: callers per user, queued in that order; ``idle``: each user's idle sandboxes by ``since``."""
    loop = asyncio.new_event_loop()
    try:
        queues: dict[str, list[Waiter]] = {}
        arrival: dict[Waiter, int] = {}
        for user, count in waiting.items():
            for _ in range(count):
                waiter = Waiter(user, loop.create_future())
                arrival[waiter] = len(arrival)
                queues.setdefault(user, []).append(waiter)
        idle_of = {user: [PooledSandbox(user, State.IDLE, since=since) for since in sinces]
                   for user, sinces in (idle or {}).items()}
        held = {user: (held or {}).get(user, 0) for user in queues}
        counts = Counts(held=held, starting={user: (starting or {}).get(user, 0) for user in queues},
                        owned={user: (owned or {}).get(user, held[user] + len(idle_of.get(user, ())))
                               for user in queues},
                        total=total, held_total=sum(held.values()) if held_total is None else held_total,
                        stopping=stopping)
        given: dict[str, Any] = {"queues": {u: list(q) for u, q in queues.items()},
                                 "idle_of": {u: list(i) for u, i in idle_of.items()}, "counts": repr(counts)}
        decisions = serve_fairly(queues, idle_of, arrival, counts,
                                 Limits(max_per_user=max_per_user, max_total=max_total, ceiling=max_total - reserve))
        # A pure function of what it is given: it decides, and changes none of it.
        assert given == {"queues": queues, "idle_of": idle_of, "counts": repr(counts)}
        for decision in decisions:  # an eviction is of another user's idle sandbox, for a waiting user
            assert not isinstance(decision, Evict) or (decision.sandbox.user != decision.user
                                                       and decision.user in queues)
        return [said(decision) for decision in decisions]
    finally:
        loop.close()


def test_a_user_gets_starts_up_to_max_per_user_and_no_more() -> None:
    assert serve({"a": 5}, max_per_user=2) == [("start", "a"), ("start", "a")]


def test_turns_go_to_the_user_holding_fewest_one_caller_a_turn() -> None:
    decisions = serve({"a": 3, "b": 2}, held={"a": 2}, total=2, max_total=5)
    assert decisions == [("start", "b"), ("start", "b"), ("start", "a")]


def test_a_users_own_idle_sandbox_comes_before_a_start() -> None:
    assert serve({"a": 1}, idle={"a": [5.0]}, total=1) == [("hand", "a<-a")]


def test_calls_beyond_a_users_first_leave_the_reserve_to_first_calls() -> None:
    # 7 of 8 held, reserve 2 (ceiling 6): a, holding 4, waits; c, holding none, is started.
    decisions = serve({"a": 1, "c": 1}, held={"a": 4}, owned={"a": 4}, total=7, held_total=7, reserve=2)
    assert decisions == [("start", "c")]


def test_a_full_pool_evicts_a_quiet_users_spares_first_then_one_of_who_holds_more() -> None:
    # Full (8 of 8): a's two callers take the quiet q's spares (the longest idle first), and b,
    # waiting too, is handed its own idle sandbox.
    assert serve({"a": 2, "b": 1}, held={"b": 3}, idle={"q": [2.0, 1.0], "b": [7.0]}, total=8) == \
        [("evict", "q"), ("evict", "q"), ("hand", "b<-b")]
    # No spare: b waits too but holds 3 to a's 0, so it gives way with its longest idle one, and
    # its caller gets the other.
    assert serve({"a": 1, "b": 1}, held={"b": 3}, idle={"b": [3.0, 4.0]}, total=8) == \
        [("evict", "b"), ("hand", "b<-b")]


def test_room_on_its_way_is_claimed_before_anything_is_evicted() -> None:
    assert serve({"a": 1}, idle={"q": [1.0]}, total=8, stopping=1) == []


def test_nothing_is_taken_from_a_user_holding_no_more_than_the_caller() -> None:
    assert serve({"a": 1, "b": 1}, held={"a": 2, "b": 2}, idle={"b": [1.0]}, total=8, held_total=4) == \
        [("hand", "b<-b")]
