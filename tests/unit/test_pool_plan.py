"""Pool._plan is a decision, not an action: it changes nothing (issue 37). What it returns is
applied by _commit, the one place the pool's state changes, and only then by I/O."""

from __future__ import annotations

import asyncio
from typing import Any

from sandboxd.sandbox.pool import Pool, State
from tests.unit.test_pool import Clock, make_pool, run, settle


def snapshot(pool: Pool) -> Any:
    """Everything a plan could change: each sandbox's fields, the queue, the bookkeeping."""
    sandboxes = [(id(p), p.user, p.state, p.since, p.call_ended, p.spent, p.removed) for p in pool._sandboxes]
    return (sandboxes, {u: [id(p) for p in mine] for u, mine in pool._of_user.items()},
            [(id(w), w.future.done()) for w in pool._waiters], dict(pool._last_call), dict(pool._backoff_until),
            dict(pool.stats))


def test_a_plan_changes_nothing_until_it_is_committed() -> None:
    async def main() -> None:
        clock = Clock()
        pool = make_pool(clock=clock, max_per_user=1, max_total=2, min_idle=0)
        a = await pool.acquire("a@x.io")
        b = await pool.acquire("b@x.io")
        waiting = asyncio.ensure_future(pool.acquire("c@x.io"))  # the pool is full: c waits
        await settle()
        assert not waiting.done()
        # A fact recorded, not yet acted on: a's call ended. A plan makes that sandbox idle and,
        # c holding none and a holding none once it is, evicts it to start one for c.
        a.call_ended = True
        clock.now += 1
        before = snapshot(pool)
        for user in (None, "a@x.io", "b@x.io", "c@x.io"):
            plan = pool._plan(user)
            assert snapshot(pool) == before, user
        plan = pool._plan()
        assert plan.ready == [a] and plan.destroy == [a] and not plan.hand  # it did decide something
        assert snapshot(pool) == before
        # The same facts through release: committed, then acted on, c is served.
        a.call_ended = False
        pool.release(a, reusable=True)
        assert (await waiting).user == "c@x.io"
        assert a.state is State.STOPPING or a not in pool._sandboxes
        pool.release(b, reusable=True)
        await pool.close(grace=0)

    run(main())
