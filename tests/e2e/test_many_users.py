"""Many ordinary users at once (issue 25): what one user can and cannot take from the others.

Real daemons, real Docker, busy but well-behaved tools: the pool's slots are shared max-min
fairly with a reserve for first calls (docs/design.md, "Sharing the pool"). Timing bounds
here are far from what the mechanism gives (a newcomer waits for one sandbox start, ~0.5 s;
without the reserve it waits for the first 40-s call to end), so a slow machine does not
turn them red; the figures themselves are `make bench`'s ("noisy neighbours").
"""

from __future__ import annotations

import time
from typing import Any

import pytest

from tests.e2e.neighbours import Background, wait_for_pool

pytestmark = pytest.mark.docker

HEAVY = [f"heavy{i}@example.com" for i in range(8)]
NEWCOMERS = [f"new{i}@example.com" for i in range(4)]


def test_a_user_with_nothing_running_is_served_while_eight_users_hold_every_slot(make_daemon: Any) -> None:
    # The case: 8 users x 6 calls of 40 s, max_per_user 4, max_total 32 (reserve: the default, 4).
    daemon = make_daemon(config="pool:\n  max_per_user: 4\n  max_total: 32\n  acquire_timeout_ms: 60000\n")
    background = Background(daemon)
    try:
        for user in HEAVY:
            for _ in range(6):
                background.call(user, "sleeper", {"ms": 40_000}, timeoutMs=60_000)
        pool = wait_for_pool(daemon, lambda p: p["totals"]["busy"] >= 28 and p["totals"]["starting"] == 0, 90,
                             "eight users filling the pool")
        filled_at = time.monotonic()

        newcomers = [background.call(user, "hello", {"name": user}) for user in NEWCOMERS]
        background.wait(newcomers, 15)
        for outcome in newcomers:
            assert outcome.result is not None and outcome.result["status"] == "ok", (outcome, daemon.log())
            assert outcome.seconds is not None and outcome.seconds <= 3.0, [o.seconds for o in newcomers]
        assert all(o.answered_at is not None and o.answered_at - filled_at < 40 for o in newcomers)
        # Calls beyond a user's first stopped at max_total - reserve; everyone got at least three.
        holding = {user: pool["users"][user]["holding"] for user in HEAVY}
        assert sum(holding.values()) == 28 and min(holding.values()) >= 3, pool
        assert all(pool["users"][user]["waiting"] == 6 - holding[user] for user in HEAVY), pool

        with daemon.client() as client:
            status = client.request("sandbox/status")
        # Nobody's running call was killed to make room.
        assert status["pool"]["counters"]["killed"] == 0 and status["pool"]["counters"]["crashed"] == 0
        assert status["pool"]["sharing"]["reserve"] == 4 and status["pool"]["sharing"]["activeUsers"] == 8
        assert sum(status["pool"]["users"][user]["holding"] for user in HEAVY) == 28
    finally:
        background.close()


def test_queued_callers_are_served_in_a_fair_order_across_users(make_daemon: Any) -> None:
    # a holds the whole (small) pool; b queues four callers, then c two. When a's two short calls
    # end, b and c (both holding none) get one sandbox each, and c's second caller reuses c's own:
    # c is done before b's first call, queued earlier, ends. Without fairness the freed sandboxes
    # go to b's queue until it is empty, and c waits behind it.
    daemon = make_daemon(config="pool:\n  max_per_user: 4\n  max_total: 4\n  reserve: 0\n  min_idle: 0\n"
                                "  acquire_timeout_ms: 60000\n")
    background = Background(daemon)
    try:
        for ms in (3000, 3000, 20000, 20000):
            background.call("a@example.com", "sleeper", {"ms": ms}, timeoutMs=60_000)
        wait_for_pool(daemon, lambda p: p["totals"]["busy"] == 4, 60, "a filling the pool")
        b_calls = [background.call("b@example.com", "sleeper", {"ms": 3000}, timeoutMs=60_000) for _ in range(4)]
        wait_for_pool(daemon, lambda p: p["totals"]["waiting"] == 4, 30, "b's callers queueing")
        late = [background.call("c@example.com", "hello", {"name": "c"}) for _ in range(2)]
        wait_for_pool(daemon, lambda p: p["totals"]["waiting"] == 6, 30, "c's callers queueing")
        background.wait(late, 30)
        for outcome in late:
            assert outcome.result is not None and outcome.result["status"] == "ok", (outcome, daemon.log())
        c_done = max(o.answered_at for o in late if o.answered_at is not None)
        background.wait(b_calls, 30)
        assert all(o.result is not None and o.result["status"] == "ok" for o in b_calls), b_calls
        b_first = min(o.answered_at for o in b_calls if o.answered_at is not None)
        assert c_done < b_first, f"c done {b_first - c_done:.1f} s after b's first call"
        with daemon.client() as client:
            pool = client.request("sandbox/status")["pool"]
        assert pool["counters"]["killed"] == 0 and pool["refusals"] == {"user_limit": 0, "reserve": 0, "pool_full": 0}
    finally:
        background.close()
