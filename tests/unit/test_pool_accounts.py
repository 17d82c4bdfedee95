"""The pool counts a user once, whatever email access their sandboxes carry (sandbox/email_access.py):
max_per_user, min_idle and the fair share sum the user's owners; at the limit, an idle sandbox of
another access gives way to the one a caller needs."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from sandboxd.errors import Overloaded
from sandboxd.sandbox.email_access import owner
from sandboxd.sandbox.fake import FakeBackend
from sandboxd.sandbox.pool import State
from sandboxd.sandbox.pooled import Waiter
from sandboxd.sandbox.warm import used_last
from tests.unit.test_pool import make_pool, run, settle

A, B, C = "a@x.io", "b@x.io", "c@x.io"
WRITE, NONE, READ = owner(A, "write"), owner(A, "none"), owner(A, "read")


def test_max_per_user_counts_every_access_together() -> None:
    async def main() -> None:
        backend = FakeBackend()
        pool = make_pool(backend, min_idle=0, max_per_user=2, max_total=6, acquire_timeout_ms=100)
        held = [await pool.acquire(WRITE), await pool.acquire(NONE)]
        with pytest.raises(Overloaded, match=r"a@x\.io already holds 2 sandboxes.*pool\.max_per_user: 2") as info:
            await pool.acquire(READ)  # a third access is no way around the limit
        assert info.value.data is not None and info.value.data["reason"] == "user_limit"
        assert backend.starts == 2 and pool.status()["users"][A]["busy"] == 2
        assert (await pool.acquire(B)).user == B  # the pool has room: only a's own limit held them back
        for pooled in held:
            pool.release(pooled, reusable=True)

    run(main())


def test_at_the_limit_an_idle_sandbox_of_another_access_gives_way_in_the_same_plan() -> None:
    async def main() -> None:
        backend = FakeBackend()
        backend.destroy_delay = 0.05
        pool = make_pool(backend, min_idle=0, max_per_user=1, max_total=4, acquire_timeout_ms=2000)
        writer = await pool.acquire(WRITE)
        pool.release(writer, reusable=True)
        await settle()
        # The plan for a none caller destroys the idle write sandbox and starts theirs, both at once.
        waiter = Waiter(NONE, asyncio.get_running_loop().create_future())
        pool._waiters.append(waiter)
        plan = pool._plan()
        pool._waiters.remove(waiter)
        assert plan.destroy == [writer] and plan.start == [NONE] and not plan.hand
        nothing = await pool.acquire(NONE)
        assert nothing.user == NONE and writer.state is State.STOPPING and not writer.removed  # not after its removal
        await asyncio.sleep(0.1)
        assert writer not in pool._sandboxes and backend.starts == 2 and len(backend.destroyed) == 1
        pool.release(nothing, reusable=True)

    run(main())


def test_at_the_limit_with_everything_busy_a_caller_waits_and_is_refused_at_the_deadline() -> None:
    async def main() -> None:
        backend = FakeBackend()
        pool = make_pool(backend, min_idle=0, max_per_user=1, max_total=4, acquire_timeout_ms=100)
        writer = await pool.acquire(WRITE)
        with pytest.raises(Overloaded, match="pool.max_per_user"):
            await pool.acquire(NONE)  # the write sandbox is busy: nothing gives way
        assert backend.starts == 1 and writer.state is State.BUSY and not pool._waiters
        # Its release makes room: the next none caller gets the write sandbox's place.
        pool.release(writer, reusable=True)
        nothing = await pool.acquire(NONE)
        assert nothing.user == NONE and backend.starts == 2
        pool.release(nothing, reusable=True)

    run(main())


def test_a_waiting_caller_of_another_access_served_at_a_release() -> None:
    async def main() -> None:
        pool = make_pool(min_idle=0, max_per_user=1, max_total=4, acquire_timeout_ms=2000)
        writer = await pool.acquire(WRITE)
        waiting = asyncio.ensure_future(pool.acquire(NONE))
        await settle()
        assert not waiting.done()
        pool.release(writer, reusable=True)
        nothing = await waiting
        assert nothing.user == NONE and (writer.state is State.STOPPING or writer not in pool._sandboxes)
        pool.release(nothing, reusable=True)

    run(main())


def test_a_caller_cancelled_while_waiting_or_as_its_replacement_starts_leaks_no_slot() -> None:
    async def main() -> None:
        backend = FakeBackend()
        backend.start_delay = 0.02
        pool = make_pool(backend, min_idle=0, max_per_user=1, max_total=4, acquire_timeout_ms=2000)
        writer = await pool.acquire(WRITE)
        waiting = asyncio.ensure_future(pool.acquire(NONE))
        await settle()
        waiting.cancel()  # while all of a's sandboxes are busy
        with pytest.raises(asyncio.CancelledError):
            await waiting
        pool.release(writer, reusable=True)
        await settle()
        assert repr(pool) == "<Pool [starting: 0, idle: 1, busy: 0, stopping: 0, waiting: 0]>"  # nothing replaced
        # Cancelled once its replacement is on its way: the new sandbox stays, idle, in the old one's place.
        waiting = asyncio.ensure_future(pool.acquire(NONE))
        await settle()
        assert writer.state is State.STOPPING or writer not in pool._sandboxes
        waiting.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiting
        await asyncio.sleep(0.1)
        assert repr(pool) == "<Pool [starting: 0, idle: 1, busy: 0, stopping: 0, waiting: 0]>"
        assert [p.user for p in pool._of_user[A]] == [NONE]
        again = await pool.acquire(NONE)
        assert again.user == NONE and backend.starts == 2
        pool.release(again, reusable=True)

    run(main())


def test_min_idle_counts_a_users_idle_sandboxes_of_every_access_together() -> None:
    async def main() -> None:
        backend = FakeBackend()
        pool = make_pool(backend, min_idle=1, max_per_user=4, max_total=8)
        pool.warm(NONE)  # a listing: the access most of their tools need
        await settle()
        assert [p.user for p in pool._sandboxes] == [NONE] and backend.starts == 1
        writer = await pool.acquire(WRITE)  # an undeclared tool: the none spare stays idle
        await settle()
        assert backend.starts == 2 and pool.status()["users"][A]["idle"] == 1  # no write spare beside it
        pool.release(writer, reusable=True)
        await settle()
        assert pool.status()["users"][A]["idle"] == 2 and backend.starts == 2

    run(main())


def test_the_spare_carries_the_access_used_last() -> None:
    last_call = {WRITE: 5.0, NONE: 7.0, B: 1.0, READ: 6.0}
    assert used_last(last_call, last_call) == {A: NONE, B: B}
    assert used_last([READ, WRITE], {READ: 3.0, WRITE: 3.0}) == {A: READ}  # a tie: the first named

    async def main() -> None:
        backend = FakeBackend()
        pool = make_pool(backend, min_idle=1, max_per_user=4, max_total=8)
        nothing = await pool.acquire(NONE)
        writer = await pool.acquire(WRITE)  # the none spare is not theirs: a write sandbox starts
        await settle()
        pool.release(nothing, reusable=True)
        await settle()
        spare = [p for p in pool._sandboxes if p.current is State.IDLE]
        # Two idle (the none spare, the none released), none of write's: min_idle is met together.
        assert [p.user for p in spare] == [NONE, NONE] and backend.starts == 3
        pool.release(writer, reusable=True)

    run(main())


def test_the_fair_share_counts_a_users_accesses_together() -> None:
    async def main() -> None:
        pool = make_pool(min_idle=0, max_per_user=3, max_total=4, reserve=0, acquire_timeout_ms=2000)
        held = [await pool.acquire(WRITE), await pool.acquire(NONE), await pool.acquire(B), await pool.acquire(C)]
        for_a = asyncio.ensure_future(pool.acquire(READ))  # a holds 2 sandboxes (of two accesses), b holds 1
        await settle()
        for_b = asyncio.ensure_future(pool.acquire(B))
        await settle()
        pool.release(held[3], reusable=True)  # the room c frees goes to b, who holds fewer, though a asked first
        served: Any = await for_b
        assert served.user == B and not for_a.done()
        pool.release(held[1], reusable=True)  # a's own none sandbox gives way to their read caller
        assert (await for_a).user == READ
        for pooled in (held[0], held[2], served):
            pool.release(pooled, reusable=True)

    run(main())
