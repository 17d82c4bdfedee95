"""Pool logic on the fake backend: the pool's state is asserted after each step."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

from sandboxd.config import PoolConfig
from sandboxd.errors import BackendUnavailable, Overloaded, ShuttingDown
from sandboxd.sandbox.backend import CallRequest, SandboxSpec
from sandboxd.sandbox.email_access import owner_user
from sandboxd.sandbox.fake import FakeBackend
from sandboxd.sandbox.pool import Pool, State
from sandboxd.sandbox.pooled import Waiter


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def spec_for(user: str) -> SandboxSpec:
    root = Path("/nonexistent")
    return SandboxSpec(user, root / "tools", root / user, root / user / "tools", None)


def make_pool(backend: FakeBackend | None = None, clock: Clock | None = None, **overrides: Any) -> Pool:
    settings = {"max_per_user": 2, "max_total": 3, "min_idle": 1, "idle_ttl_s": 60, "acquire_timeout_ms": 200,
                "max_calls_per_sandbox": 3} | overrides
    return Pool(backend or FakeBackend(), PoolConfig(**settings), spec_for, clock=clock or Clock())


async def settle() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


def run(coro: Any) -> Any:
    return asyncio.run(coro)


def test_first_call_starts_a_sandbox_and_keeps_one_warm() -> None:
    async def main() -> None:
        backend = FakeBackend()
        pool = make_pool(backend)
        assert repr(pool) == "<Pool [starting: 0, idle: 0, busy: 0, stopping: 0, waiting: 0]>"
        pooled = await pool.acquire("a@x.io")
        assert pooled.state is State.BUSY and pooled.user == "a@x.io"
        await settle()
        # min_idle=1: a second sandbox warms up while the first one is busy.
        assert repr(pool) == "<Pool [starting: 0, idle: 1, busy: 1, stopping: 0, waiting: 0]>"
        pool.release(pooled, reusable=True)
        assert repr(pool) == "<Pool [starting: 0, idle: 2, busy: 0, stopping: 0, waiting: 0]>"
        assert backend.starts == 2

    run(main())


def test_the_warm_spare_starts_only_once_the_waiting_caller_is_served() -> None:
    async def main() -> None:
        backend = FakeBackend()
        backend.start_delay = 0.02
        pool = make_pool(backend)
        caller = asyncio.ensure_future(pool.acquire("a@x.io"))
        await settle()
        # Two starts at once would share the CPU with the one the caller waits for.
        assert repr(pool) == "<Pool [starting: 1, idle: 0, busy: 0, stopping: 0, waiting: 1]>" and backend.starts == 1
        pooled = await caller
        await settle()
        assert repr(pool) == "<Pool [starting: 1, idle: 0, busy: 1, stopping: 0, waiting: 0]>" and backend.starts == 2
        await asyncio.sleep(0.05)
        assert repr(pool) == "<Pool [starting: 0, idle: 1, busy: 1, stopping: 0, waiting: 0]>"
        pool.release(pooled, reusable=True)

    run(main())


def test_idle_sandbox_is_reused_without_a_start() -> None:
    async def main() -> None:
        backend = FakeBackend()
        pool = make_pool(backend, min_idle=0)
        first = await pool.acquire("a@x.io")
        pool.release(first, reusable=True)
        second = await pool.acquire("a@x.io")
        assert second is first and backend.starts == 1
        assert repr(pool) == "<Pool [starting: 0, idle: 0, busy: 1, stopping: 0, waiting: 0]>"

    run(main())


def test_sandboxes_belong_to_one_user() -> None:
    async def main() -> None:
        pool = make_pool(min_idle=0)
        a = await pool.acquire("a@x.io")
        pool.release(a, reusable=True)
        b = await pool.acquire("b@x.io")
        assert b is not a and b.user == "b@x.io"
        assert repr(pool) == "<Pool [starting: 0, idle: 1, busy: 1, stopping: 0, waiting: 0]>"

    run(main())


def test_per_user_limit_queues_then_times_out_with_overloaded() -> None:
    async def main() -> None:
        pool = make_pool(min_idle=0, acquire_timeout_ms=50)
        held = [await pool.acquire("a@x.io"), await pool.acquire("a@x.io")]
        assert repr(pool) == "<Pool [starting: 0, idle: 0, busy: 2, stopping: 0, waiting: 0]>"
        with pytest.raises(Overloaded) as info:
            await pool.acquire("a@x.io")
        assert "a@x.io already holds 2 sandboxes" in info.value.message and "pool.max_per_user: 2" in info.value.message
        assert info.value.data["reason"] == "user_limit" and pool.refusals["user_limit"] == 1
        # The timed-out waiter left nothing behind.
        assert repr(pool) == "<Pool [starting: 0, idle: 0, busy: 2, stopping: 0, waiting: 0]>"
        assert len(held) == 2

    run(main())


def test_queued_caller_gets_the_released_sandbox() -> None:
    async def main() -> None:
        backend = FakeBackend()
        pool = make_pool(backend, min_idle=0, max_per_user=1)
        first = await pool.acquire("a@x.io")
        waiter = asyncio.ensure_future(pool.acquire("a@x.io"))
        await settle()
        assert repr(pool) == "<Pool [starting: 0, idle: 0, busy: 1, stopping: 0, waiting: 1]>"
        pool.release(first, reusable=True)
        assert (await waiter) is first
        assert repr(pool) == "<Pool [starting: 0, idle: 0, busy: 1, stopping: 0, waiting: 0]>"
        assert backend.starts == 1

    run(main())


def test_cancelled_waiter_never_leaks_a_slot() -> None:
    async def main() -> None:
        pool = make_pool(min_idle=0, max_per_user=1)
        first = await pool.acquire("a@x.io")
        waiter = asyncio.ensure_future(pool.acquire("a@x.io"))
        await settle()
        # Hand the sandbox over and cancel the waiter in the same tick.
        pool.release(first, reusable=True)
        waiter.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiter
        assert repr(pool) == "<Pool [starting: 0, idle: 1, busy: 0, stopping: 0, waiting: 0]>"
        again = await pool.acquire("a@x.io")
        assert again is first

    run(main())


def test_global_limit_evicts_another_users_idle_sandbox() -> None:
    async def main() -> None:
        backend = FakeBackend()
        pool = make_pool(backend, min_idle=0, max_total=2)
        for user in ("a@x.io", "b@x.io"):
            pool.release(await pool.acquire(user), reusable=True)
        assert repr(pool) == "<Pool [starting: 0, idle: 2, busy: 0, stopping: 0, waiting: 0]>"
        c = await pool.acquire("c@x.io")
        await settle()
        assert c.user == "c@x.io"
        assert repr(pool) == "<Pool [starting: 0, idle: 1, busy: 1, stopping: 0, waiting: 0]>"
        assert len(backend.destroyed) == 1  # a@x.io's, the longest idle

    run(main())


def test_a_sandbox_being_destroyed_still_counts_against_the_limits() -> None:
    async def main() -> None:
        backend = FakeBackend()
        backend.destroy_delay = 0.05  # the engine takes its time to remove a container
        pool = make_pool(backend, min_idle=0, max_per_user=1)
        first = await pool.acquire("a@x.io")
        pool.release(first, reusable=False)  # e.g. it timed out
        assert repr(pool) == "<Pool [starting: 0, idle: 0, busy: 0, stopping: 1, waiting: 0]>"
        queued = asyncio.ensure_future(pool.acquire("a@x.io"))
        await settle()
        # No second container for the user while the first still exists.
        assert repr(pool) == "<Pool [starting: 0, idle: 0, busy: 0, stopping: 1, waiting: 1]>" and backend.starts == 1
        second = await queued
        assert first.sandbox is not None and first.sandbox.id in backend.destroyed and second is not first
        assert repr(pool) == "<Pool [starting: 0, idle: 0, busy: 1, stopping: 0, waiting: 0]>"

    run(main())


def test_a_full_pool_evicts_one_idle_sandbox_per_waiter_and_no_more() -> None:
    async def main() -> None:
        backend = FakeBackend()
        backend.destroy_delay = 0.05
        pool = make_pool(backend, min_idle=0, max_total=3)
        for user in ("a@x.io", "b@x.io", "e@x.io"):
            pool.release(await pool.acquire(user), reusable=True)
        c = asyncio.ensure_future(pool.acquire("c@x.io"))
        d = asyncio.ensure_future(pool.acquire("d@x.io"))
        await settle()
        # One eviction for each waiter, at once; the third idle sandbox stays.
        assert repr(pool) == "<Pool [starting: 0, idle: 1, busy: 0, stopping: 2, waiting: 2]>"
        assert (await c).user == "c@x.io" and (await d).user == "d@x.io"
        await settle()
        assert repr(pool) == "<Pool [starting: 0, idle: 1, busy: 2, stopping: 0, waiting: 0]>"
        assert len(backend.destroyed) == 2 and backend.starts == 5
        assert pool.status()["users"]["e@x.io"]["idle"] == 1  # the newest idle one was kept

    run(main())


def test_unusable_sandbox_is_destroyed_and_replaced_in_the_background() -> None:
    async def main() -> None:
        backend = FakeBackend()
        pool = make_pool(backend, min_idle=1)
        pooled = await pool.acquire("a@x.io")
        await settle()
        assert repr(pool) == "<Pool [starting: 0, idle: 1, busy: 1, stopping: 0, waiting: 0]>"
        pool.release(pooled, reusable=False)  # e.g. it timed out
        await settle()
        assert pooled.sandbox is not None and pooled.sandbox.id in backend.destroyed
        # The warm one serves the next call at once; no caller waits for the replacement.
        assert repr(pool) == "<Pool [starting: 0, idle: 1, busy: 0, stopping: 0, waiting: 0]>"

    run(main())


def test_recycled_after_max_calls() -> None:
    async def main() -> None:
        backend = FakeBackend()
        pool = make_pool(backend, min_idle=0, max_calls_per_sandbox=2)
        first = await pool.acquire("a@x.io")
        pool.release(first, reusable=True)
        assert (await pool.acquire("a@x.io")) is first
        pool.release(first, reusable=True)
        await settle()
        assert first.sandbox is not None and first.sandbox.id in backend.destroyed
        assert repr(pool) == "<Pool [starting: 0, idle: 0, busy: 0, stopping: 0, waiting: 0]>"

    run(main())


def test_dead_idle_sandbox_never_receives_a_call() -> None:
    async def main() -> None:
        backend = FakeBackend()
        pool = make_pool(backend, min_idle=1)
        pooled = await pool.acquire("a@x.io")
        pool.release(pooled, reusable=True)
        await settle()
        for sandbox in list(backend.sandboxes.values()):
            sandbox.die()
        await settle()
        fresh = await pool.acquire("a@x.io")
        assert fresh.sandbox is not None and fresh.sandbox.alive
        future = fresh.sandbox.call(CallRequest("c1", "/x/index.ts", {}), lambda content: None)
        assert (await future)["status"] == "ok"
        assert backend.calls_to_dead == 0
        assert pool.stats["crashed"] == 2

    run(main())


def test_idle_ttl_cools_a_quiet_user_down() -> None:
    async def main() -> None:
        clock = Clock()
        backend = FakeBackend()
        pool = make_pool(backend, clock, min_idle=1, idle_ttl_s=60)
        pool.release(await pool.acquire("a@x.io"), reusable=True)
        await settle()
        assert repr(pool) == "<Pool [starting: 0, idle: 2, busy: 0, stopping: 0, waiting: 0]>"
        clock.now += 30
        pool.maintain()
        await settle()
        assert repr(pool) == "<Pool [starting: 0, idle: 2, busy: 0, stopping: 0, waiting: 0]>"
        clock.now += 31
        pool.maintain()
        await settle()
        assert repr(pool) == "<Pool [starting: 0, idle: 0, busy: 0, stopping: 0, waiting: 0]>"
        assert backend.sandboxes == {}

    run(main())


def test_start_failure_reaches_the_caller_at_once() -> None:
    async def main() -> None:
        backend = FakeBackend()
        backend.unavailable()
        pool = make_pool(backend, acquire_timeout_ms=5000)
        with pytest.raises(BackendUnavailable):
            await pool.acquire("a@x.io")
        assert repr(pool) == "<Pool [starting: 0, idle: 0, busy: 0, stopping: 0, waiting: 0]>"
        # The engine comes back: the next call recovers by itself.
        backend.start_error = None
        pooled = await pool.acquire("a@x.io")
        assert pooled.state is State.BUSY

    run(main())


def test_close_refuses_new_calls_and_destroys_everything() -> None:
    async def main() -> None:
        backend = FakeBackend()
        pool = make_pool(backend, min_idle=1)
        busy = await pool.acquire("a@x.io")
        await settle()
        await pool.close(grace=0)
        assert backend.sandboxes == {}
        assert repr(pool) == "<Pool [starting: 0, idle: 0, busy: 0, stopping: 0, waiting: 0]>"
        with pytest.raises(ShuttingDown):
            await pool.acquire("a@x.io")
        pool.release(busy, reusable=True)  # a late release after close is harmless

    run(main())


def test_close_waits_for_a_busy_sandbox_until_its_call_ends() -> None:
    async def main() -> None:
        backend = FakeBackend()
        pool = make_pool(backend, min_idle=0)
        busy = await pool.acquire("a@x.io")
        closing = asyncio.ensure_future(pool.close(grace=60))
        await settle()
        assert not closing.done() and busy.sandbox is not None and busy.sandbox.id in backend.sandboxes
        pool.release(busy, reusable=True)  # no plan runs while closing: the call's end alone lets close go on
        await asyncio.wait_for(closing, timeout=10)
        assert backend.sandboxes == {}

    run(main())


def test_close_cancels_starts_in_flight() -> None:
    async def main() -> None:
        backend = FakeBackend()
        backend.start_delay = 10
        pool = make_pool(backend)
        waiter = asyncio.ensure_future(pool.acquire("a@x.io"))
        await settle()
        # One for the caller; the warm spare (min_idle=1) waits until the caller is served,
        # so that two starts do not share the CPU while someone waits.
        assert repr(pool) == "<Pool [starting: 1, idle: 0, busy: 0, stopping: 0, waiting: 1]>"
        await pool.close(grace=0)
        with pytest.raises(ShuttingDown):
            await waiter
        assert backend.sandboxes == {}

    run(main())


def test_warm_starts_min_idle_before_the_first_call() -> None:
    async def main() -> None:
        clock = Clock()
        backend = FakeBackend()
        pool = make_pool(backend, clock, min_idle=1, idle_ttl_s=60)
        pool.warm("a@x.io")
        await settle()
        assert repr(pool) == "<Pool [starting: 0, idle: 1, busy: 0, stopping: 0, waiting: 0]>"
        assert backend.starts == 1
        pool.warm("a@x.io")  # a second session start: the warm sandbox is enough
        await settle()
        assert backend.starts == 1
        # The first call takes the warm sandbox: no start on its path.
        pooled = await pool.acquire("a@x.io")
        assert pooled.state is State.BUSY and backend.starts == 1
        pool.release(pooled, reusable=True)
        await settle()
        # A warmed user who never calls cools down after the idle TTL, like any quiet user.
        pool.warm("b@x.io")
        await settle()
        assert pool.status()["users"]["b@x.io"]["idle"] == 1
        clock.now += 61
        pool.maintain()
        await settle()
        assert "b@x.io" not in pool.status()["users"]

    run(main())


def test_warm_never_evicts_and_does_nothing_without_min_idle_or_while_closing() -> None:
    async def main() -> None:
        backend = FakeBackend()
        pool = make_pool(backend, max_total=1, min_idle=1)
        pool.warm("a@x.io")
        await settle()
        pool.warm("b@x.io")  # the pool is full: b's warm-up must not evict a's sandbox
        await settle()
        assert pool.status()["users"] == {"a@x.io": {"starting": 0, "idle": 1, "busy": 0, "stopping": 0, "waiting": 0,
                                                     "holding": 0}}
        cold = make_pool(FakeBackend(), min_idle=0)
        cold.warm("a@x.io")
        await settle()
        assert repr(cold) == "<Pool [starting: 0, idle: 0, busy: 0, stopping: 0, waiting: 0]>"
        await pool.close(grace=0)
        pool.warm("c@x.io")
        await settle()
        assert backend.sandboxes == {}

    run(main())


def test_warm_on_a_full_pool_leaves_no_trace_of_the_user() -> None:
    async def main() -> None:
        clock = Clock()
        backend = FakeBackend()
        pool = make_pool(backend, clock, max_total=1, min_idle=1, idle_ttl_s=60)
        pool.warm("a@x.io")
        await settle()
        clock.now += 50
        for i in range(1000):  # a client listing for made-up users while the pool is full
            pool.warm(f"made-up-{i}@x.io")
        clock.now += 11
        pool.maintain()  # alice went quiet: her sandbox goes, and none of the made-up users get one
        await settle()
        pool.maintain()
        await settle()
        assert repr(pool) == "<Pool [starting: 0, idle: 0, busy: 0, stopping: 0, waiting: 0]>"
        assert backend.starts == 1

    run(main())


def test_a_warm_call_looks_at_its_own_users_sandboxes_only(monkeypatch: pytest.MonkeyPatch) -> None:
    # With 100 users each holding warm sandboxes, a call walking the whole pool twice (its
    # acquire and its release) cost ~270 µs more than with one user (CHANGELOG.md, 2026-12-01).
    async def main() -> None:
        backend = FakeBackend()
        pool = make_pool(backend, max_per_user=4, max_total=300, min_idle=1, max_calls_per_sandbox=1000)
        users = [f"u{i}@x.io" for i in range(100)]
        for user in users:
            pool.release(await pool.acquire(user), reusable=True)
        await settle()
        assert len(pool._sandboxes) == 200
        plans: list[str | None] = []  # whose sandboxes each plan looked at (None: everyone's)
        real = pool._plan
        monkeypatch.setattr(pool, "_plan", lambda user=None, **kw: (plans.append(user), real(user, **kw))[1])
        for _ in range(10):
            pooled = await pool.acquire(users[7])
            assert pooled.user == users[7] and pooled.state is State.BUSY
            pool.release(pooled, reusable=True)
            # Settled idle by the next plan (nobody waits for it); idle to anyone who asks meanwhile.
            assert pooled.state is State.BUSY and pool.status()["users"][users[7]]["idle"] == 2
        # No plan at all: a caller alone taking an idle sandbox while one stays for min_idle is all a plan
        # would do (Pool._idle_for_alone); a release that nobody waits on plans nothing.
        assert plans == []
        # The user's spare is kept: their last idle one taken by a plan of theirs, the next starts at once.
        first, second = await pool.acquire(users[3]), await pool.acquire(users[3])
        assert plans == [users[3]] and backend.starts == 200
        await settle()  # the spare's start plans for its user once it is up: off every call's path
        assert {p.state for p in pool._of_user[users[3]]} == {State.BUSY, State.IDLE} and backend.starts == 201
        pool.release(first, reusable=True)
        pool.release(second, reusable=False)  # not reusable: destroyed at once, its user's plan decides
        assert None not in plans and second.state is State.STOPPING
        await settle()  # its removal frees room for anyone: a plan of everything
        assert plans[-1] is None and second not in pool._sandboxes
        await pool.close(grace=0)

    run(main())


# -- sharing the pool: max-min fairness and the reserve (docs/design.md, "Sharing the pool") -----


async def hold(pool: Pool, user: str, count: int) -> list[asyncio.Future[Any]]:
    """``count`` concurrent callers of ``user``, as futures (each resolves to its sandbox once served)."""
    callers = [asyncio.ensure_future(pool.acquire(user)) for _ in range(count)]
    await settle()
    return callers


def served(callers: list[asyncio.Future[Any]]) -> list[Any]:
    return [c.result() for c in callers if c.done() and not c.cancelled() and c.exception() is None]


def holding(pool: Pool) -> dict[str, tuple[int, int]]:
    """user → (holding, waiting)."""
    return {user: (row["holding"], row["waiting"]) for user, row in pool.status()["users"].items()}


def test_a_user_with_nothing_running_is_served_from_the_reserve_while_others_hold_the_rest() -> None:
    async def main() -> None:
        backend = FakeBackend()
        pool = make_pool(backend, min_idle=0, max_per_user=4, max_total=8, reserve=2, acquire_timeout_ms=60_000)
        heavy = {user: await hold(pool, user, 6) for user in ("h1@x.io", "h2@x.io")}
        await settle()
        # Calls beyond a user's first stop at max_total - reserve = 6 in all.
        assert holding(pool) == {"h1@x.io": (4, 2), "h2@x.io": (2, 4)}
        newcomers = {user: await hold(pool, user, 1) for user in ("n1@x.io", "n2@x.io")}
        await settle()
        assert all(served(callers) for callers in newcomers.values())
        assert repr(pool) == "<Pool [starting: 0, idle: 0, busy: 8, stopping: 0, waiting: 6]>"
        # A third newcomer finds the pool full: it is next, at the first release.
        late = await hold(pool, "n3@x.io", 1)
        assert not served(late)
        pool.release(served(heavy["h1@x.io"])[0], reusable=True)
        await settle()
        assert served(late) and late[0].result().user == "n3@x.io"
        assert holding(pool)["h1@x.io"] == (3, 2)  # h1 gave way: its own waiter did not get the sandbox
        for callers in [*heavy.values(), *newcomers.values(), late]:
            for c in callers:
                c.cancel()
        await pool.close(grace=0)

    run(main())


def test_freed_sandboxes_go_to_the_waiting_user_holding_fewest() -> None:
    async def main() -> None:
        backend = FakeBackend()
        pool = make_pool(backend, min_idle=0, max_per_user=4, max_total=4, reserve=0, acquire_timeout_ms=60_000)
        a = await hold(pool, "a@x.io", 4)
        b = await hold(pool, "b@x.io", 2)  # arrives first, holds nothing
        c = await hold(pool, "c@x.io", 1)
        assert holding(pool) == {"a@x.io": (4, 0), "b@x.io": (0, 2), "c@x.io": (0, 1)}
        releases = iter(served(a))
        pool.release(next(releases), reusable=True)
        await settle()
        assert holding(pool) == {"a@x.io": (3, 0), "b@x.io": (1, 1), "c@x.io": (0, 1)}
        pool.release(next(releases), reusable=True)
        await settle()
        # c holds none and b one: c goes first, though b's second caller came earlier.
        assert holding(pool) == {"a@x.io": (2, 0), "b@x.io": (1, 1), "c@x.io": (1, 0)}
        pool.release(next(releases), reusable=True)
        await settle()
        assert holding(pool) == {"a@x.io": (1, 0), "b@x.io": (2, 0), "c@x.io": (1, 0)}
        assert backend.starts == 7 and len(backend.destroyed) == 3  # each freed sandbox went to another user
        for c_ in [*a, *b, *c]:
            c_.cancel()
        await pool.close(grace=0)

    run(main())


def test_a_user_keeps_their_released_sandbox_unless_a_waiting_user_holds_fewer() -> None:
    async def main() -> None:
        backend = FakeBackend()
        pool = make_pool(backend, min_idle=0, max_per_user=3, max_total=4, reserve=0, acquire_timeout_ms=60_000)
        b = await hold(pool, "b@x.io", 2)
        a = await hold(pool, "a@x.io", 3)  # two running, one waiting
        assert holding(pool) == {"a@x.io": (2, 1), "b@x.io": (2, 0)}
        pool.release(served(a)[0], reusable=True)
        await settle()
        # Without the sandbox a holds one, fewer than b: a's waiter gets it back, no start.
        assert holding(pool) == {"a@x.io": (2, 0), "b@x.io": (2, 0)} and backend.starts == 4
        more_b = await hold(pool, "b@x.io", 1)
        pool.release(served(b)[0], reusable=True)
        await settle()
        # b would hold one, a holds two: b keeps its own.
        assert holding(pool) == {"a@x.io": (2, 0), "b@x.io": (2, 0)} and backend.starts == 4 and served(more_b)
        b += more_b
        for c_ in [*a, *b]:
            c_.cancel()
        await pool.close(grace=0)

    run(main())


def test_a_users_own_callers_are_served_first_come_first_served() -> None:
    async def main() -> None:
        pool = make_pool(min_idle=0, max_per_user=1, max_total=2, reserve=0, acquire_timeout_ms=60_000)
        first = await pool.acquire("a@x.io")
        queued = [asyncio.ensure_future(pool.acquire("a@x.io")) for _ in range(3)]
        await settle()
        order = []
        sandbox = first
        for _ in range(3):
            pool.release(sandbox, reusable=True)
            await settle()
            (index,) = [i for i, c in enumerate(queued) if c.done() and i not in order]
            order.append(index)
            sandbox = queued[index].result()
        assert order == [0, 1, 2]
        await pool.close(grace=0)

    run(main())


def test_spares_and_the_fast_path_stay_out_of_the_reserve() -> None:
    async def main() -> None:
        backend = FakeBackend()
        pool = make_pool(backend, min_idle=1, max_per_user=4, max_total=4, reserve=2, acquire_timeout_ms=50)
        first = await pool.acquire("a@x.io")
        await settle()
        # One busy, one spare: two of four, the rest is the reserve.
        assert repr(pool) == "<Pool [starting: 0, idle: 1, busy: 1, stopping: 0, waiting: 0]>"
        second = await pool.acquire("a@x.io")  # the spare, by its user's own plan: 2 held = the ceiling
        await settle()
        assert repr(pool) == "<Pool [starting: 0, idle: 0, busy: 2, stopping: 0, waiting: 0]>"
        with pytest.raises(Overloaded) as info:
            await pool.acquire("a@x.io")
        assert info.value.data["reason"] == "reserve" and "pool.reserve" in info.value.message
        assert pool.refusals == {"user_limit": 0, "reserve": 1, "pool_full": 0}
        # Another user's first call goes into the reserve.
        b = await pool.acquire("b@x.io")
        assert b.user == "b@x.io"
        await settle()
        assert repr(pool) == "<Pool [starting: 0, idle: 0, busy: 3, stopping: 0, waiting: 0]>"  # b gets no spare
        # A released sandbox of a's, idle now, is not handed back past the ceiling by its user's plan.
        pool.release(second, reusable=True)
        pool.release(b, reusable=True)
        third = await pool.acquire("a@x.io")
        assert third is second
        with pytest.raises(Overloaded):
            await pool.acquire("a@x.io")  # 2 held (first, third), b's idle one is not a's to take
        status = pool.status()
        assert status["sharing"] == {"reserve": 2, "activeUsers": 1, "fairShare": 4}
        assert status["users"]["a@x.io"]["holding"] == 2
        pool.release(first, reusable=True)
        pool.release(third, reusable=True)
        await pool.close(grace=0)

    run(main())


def test_a_full_pool_refusal_says_so() -> None:
    async def main() -> None:
        pool = make_pool(min_idle=0, max_per_user=2, max_total=2, reserve=0, acquire_timeout_ms=50)
        held = [await pool.acquire("a@x.io"), await pool.acquire("b@x.io")]
        with pytest.raises(Overloaded) as info:
            await pool.acquire("c@x.io")
        assert info.value.data["reason"] == "pool_full" and "all 2 sandboxes are in use" in info.value.message
        assert pool.refusals["pool_full"] == 1
        for pooled in held:
            pool.release(pooled, reusable=True)
        await pool.close(grace=0)

    run(main())


def test_the_reserve_default_is_an_eighth_of_the_pool_and_must_leave_room() -> None:
    assert PoolConfig().reserved == 4 and PoolConfig(max_total=3).reserved == 0
    assert PoolConfig(max_total=10, reserve=3).reserved == 3
    with pytest.raises(ValueError, match="must be below max_total"):
        PoolConfig(max_total=4, reserve=4)


# -- properties over random interleavings -------------------------------------------------------

from hypothesis import HealthCheck, example, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

# a@x.io's callers of tools with each email access: their own owners, one user to the limits.
USERS = ("a@x.io", "b@x.io", "c@x.io", "d@x.io", "a@x.io email:none", "a@x.io email:read")
OPS = st.lists(st.one_of(
    st.tuples(st.just("acquire"), st.sampled_from(USERS)),
    st.tuples(st.just("release"), st.integers(0, 20), st.booleans()),  # which held sandbox, reusable
    st.tuples(st.just("cancel"), st.integers(0, 20)),  # which waiting caller
), max_size=40)


async def play(pool: Pool, op: tuple[Any, ...], callers: list[asyncio.Future[Any]], held: list[Any],
               clock: Clock | None = None) -> None:
    """One step of a random interleaving; then the callers served join ``held``."""
    if op[0] == "acquire":
        callers.append(asyncio.ensure_future(pool.acquire(op[1])))
    elif op[0] == "release" and held:
        pool.release(held.pop(op[1] % len(held)), reusable=op[2])
    elif op[0] == "cancel":
        waiting = [c for c in callers if not c.done()]
        if waiting:
            waiting[op[1] % len(waiting)].cancel()
    elif op[0] == "tick" and clock is not None:
        clock.now += op[1]
    elif op[0] == "die":  # an idle sandbox dies on its own
        idle = [p for p in pool._sandboxes if p.current is State.IDLE and p.sandbox is not None]
        if idle:
            idle[op[1] % len(idle)].sandbox.die()
    elif op[0] == "maintain":
        pool.maintain()
    await settle()
    for caller in [c for c in callers if c.done()]:
        callers.remove(caller)
        if not caller.cancelled() and caller.exception() is None:
            held.append(caller.result())


def check_invariants(pool: Pool) -> None:
    cfg = pool.config
    assert len(pool._sandboxes) <= cfg.max_total
    for user, mine in pool._of_user.items():
        # One more, being destroyed, where a sandbox of another access gave way (sharing.Replace).
        live = [p for p in mine if p.state is not State.STOPPING]
        assert len(live) <= cfg.max_per_user and len(mine) <= cfg.max_per_user + 1, repr(pool)
        assert all(owner_user(p.user) == user for p in mine)
    held_total = sum(1 for p in pool._sandboxes if p.state in (State.BUSY, State.STARTING))
    # Each sandbox beyond a user's first was granted below the ceiling, and no release adds one.
    extras = sum(max(0, sum(1 for p in mine if p.state in (State.BUSY, State.STARTING)) - 1)
                 for mine in pool._of_user.values())
    assert extras <= cfg.max_total - cfg.reserved, repr(pool)
    for waiter in pool._waiters:
        if waiter.future.done():
            continue
        theirs = pool._of_user.get(owner_user(waiter.user), ())
        held = sum(1 for p in theirs if p.state in (State.BUSY, State.STARTING))
        idle = [p for p in theirs if p.user == waiter.user and p.state is State.IDLE and p.sandbox is not None
                and p.sandbox.alive and not p.spent]
        blocked_by_reserve = held > 0 and held_total >= cfg.max_total - cfg.reserved
        # Work-conserving: a caller never waits beside an idle sandbox of their own it may take.
        assert not idle or blocked_by_reserve, (waiter.user, repr(pool))


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=OPS, reserve=st.integers(0, 2), per_user=st.integers(1, 5))
@example(ops=[("acquire", "a@x.io")] * 5 + [("acquire", "b@x.io")], reserve=2, per_user=5)  # the reserve
@example(ops=[("acquire", u) for u in USERS for _ in range(2)] + [("release", 0, True)], reserve=1, per_user=2)
def test_any_interleaving_keeps_the_limits_serves_idle_sandboxes_and_ends_with_everyone_served(
        ops: list[tuple[Any, ...]], reserve: int, per_user: int) -> None:
    async def main() -> None:
        backend = FakeBackend()
        pool = make_pool(backend, min_idle=1, max_per_user=per_user, max_total=5, reserve=reserve, acquire_timeout_ms=60_000,
                         max_calls_per_sandbox=4)
        callers: list[asyncio.Future[Any]] = []
        held: list[Any] = []
        for op in ops:
            await play(pool, op, callers, held)
            check_invariants(pool)
        # Everyone still waiting is served once the others give their sandboxes back.
        for _ in range(100):
            while held:
                pool.release(held.pop(), reusable=True)
            await asyncio.sleep(0.001)
            for caller in [c for c in callers if c.done()]:
                callers.remove(caller)
                held.append(caller.result())
            if not callers and not held:
                break
        assert not callers, repr(pool)
        await pool.close(grace=0)
        assert backend.sandboxes == {}

    run(main())


def check_alone_matches_plan(pool: Pool) -> int:
    """For each user a caller of whom would be alone: Pool._idle_for_alone hands the sandbox a plan
    of their user would, and only when handing it is all that plan does (no start, destroy, forget,
    nor any other caller's business). Returns how many users it served without a plan."""
    served = 0
    if pool._waiters:
        assert all(pool._idle_for_alone(user, pool._clock()) is None for user in USERS)
        return served
    for user in USERS:
        now = pool._clock()
        last = pool._last_call.get(user)
        pool._last_call[user] = now  # as acquire sets it before deciding
        try:
            taken = pool._idle_for_alone(user, now)
            if taken is None:
                continue
            served += 1
            waiter = Waiter(user, asyncio.get_running_loop().create_future())
            pool._waiters.append(waiter)
            try:
                plan = pool._plan(user)
            finally:
                pool._waiters.remove(waiter)
            assert plan.hand == [(waiter, taken)], (user, repr(pool))
            assert not (plan.start or plan.destroy or plan.forget or plan.failed or plan.fail or plan.drop or plan.quiet)
            assert all(owner_user(p.user) == owner_user(user) for p in plan.ready)
        finally:
            if last is None:
                del pool._last_call[user]
            else:
                pool._last_call[user] = last
    return served


ALONE_OPS = st.lists(st.one_of(
    st.tuples(st.just("acquire"), st.sampled_from(USERS)),
    st.tuples(st.just("release"), st.integers(0, 20), st.booleans()),
    st.tuples(st.just("tick"), st.sampled_from([0.5, 30.0, 61.0])),  # within, around and past the idle TTL
    st.tuples(st.just("die"), st.integers(0, 20)),  # an idle sandbox dies on its own
    st.tuples(st.just("maintain"),),
), max_size=40)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=ALONE_OPS, min_idle=st.integers(0, 2), per_user=st.integers(1, 4), max_total=st.integers(2, 8))
def test_a_caller_alone_gets_what_a_plan_would_hand_them(ops: list[tuple[Any, ...]], min_idle: int, per_user: int,
                                                        max_total: int) -> None:
    async def main() -> None:
        backend, clock = FakeBackend(), Clock()
        pool = make_pool(backend, clock, min_idle=min_idle, max_per_user=per_user, max_total=max_total, reserve=1,
                         acquire_timeout_ms=60_000, max_calls_per_sandbox=3)
        callers: list[asyncio.Future[Any]] = []
        held: list[Any] = []
        for op in ops:
            await play(pool, op, callers, held, clock)
            check_alone_matches_plan(pool)
            check_invariants(pool)
        for pooled in held:
            pool.release(pooled, reusable=True)
        await pool.close(grace=0)

    run(main())
