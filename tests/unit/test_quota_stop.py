"""Soft mode stops what it measures over quota (issue 44, item 7), without Docker: a user's walk
that finds them over tells the server (Storage.on_over), users with sandboxes are walked every
second without a call, and the pool replaces exactly the sandboxes that ran a tool."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

from sandboxd.config import load_config
from sandboxd.sandbox.fake import FakeBackend
from sandboxd.sandbox.pool import State
from sandboxd.storage.quota import Storage

from tests.unit.test_pool import make_pool, settle

MIB = 1 << 20


def test_the_pool_replaces_the_sandboxes_that_ran_a_tool_busy_ones_at_their_calls_end() -> None:
    async def main() -> None:
        backend = FakeBackend()
        pool = make_pool(backend, max_per_user=2, max_total=4, min_idle=1)
        used = await pool.acquire("a@x.io")
        other = await pool.acquire("b@x.io")
        await settle()
        spare = next(p for p in pool._of_user["a@x.io"] if p is not used)  # min_idle: warm, never ran a tool
        assert spare.state is State.IDLE and spare.calls == 0
        assert pool.retire("a@x.io") == [used.id]  # busy: replaced when its call ends, not handed out again
        assert used.state is State.BUSY
        pool.release(used, reusable=True)
        await settle()
        assert used not in pool._of_user["a@x.io"] and used.sandbox is not None and not used.sandbox.alive
        # The spare that ran nothing serves the next call; once it has, it is replaced at once (idle).
        again = await pool.acquire("a@x.io")
        assert again is spare
        pool.release(again, reusable=True)
        await settle()
        assert pool.retire("a@x.io") == [spare.id]
        await settle()
        assert spare not in pool._of_user.get("a@x.io", [])
        # A fresh spare for a@ (it ran nothing): no churn while they stay over quota.
        assert all(p.calls == 0 for p in pool._of_user["a@x.io"]) and pool.retire("a@x.io") == []
        assert other.state is State.BUSY and other.sandbox is not None and other.sandbox.alive  # b@ untouched
        pool.release(other, reusable=True)
        await pool.close(0)

    asyncio.run(main())


def _soft(tmp_path: Path, quota: str) -> Storage:
    store = Storage(load_config(environ={}, overrides={"data_path": tmp_path, "storage": {
        "enforcement": "soft", "quota_bytes": quota, "measure_interval_s": 600}}))
    store.resolve()
    return store


def test_a_user_with_sandboxes_is_walked_every_second_and_found_over_without_a_call(tmp_path: Path) -> None:
    store = _soft(tmp_path, "1m")
    user, quiet = "eve@example.com", "fay@example.com"
    for name in (user, quiet):
        (tmp_path / name).mkdir()
    over: list[str] = []
    store.on_over = over.append
    store.live_users = lambda: [user]  # eve has a sandbox (fay has none)

    async def main() -> None:
        await store.start()
        await asyncio.sleep(0.5)  # start-up's pass: everyone once, under quota
        assert over == [] and not store.status()["users"][user]["over"]
        walks = store.walks
        (tmp_path / user / "late").write_bytes(b"w" * 2 * MIB)  # a timer left in a sandbox writes, no call runs
        os.sync()
        for _ in range(40):
            await asyncio.sleep(0.1)
            if over:
                break
        assert over[:1] == [user], store.status()
        assert store.walks - walks <= 3  # about one a second, eve's alone: fay has no sandbox
        store.close()

    asyncio.run(main())
    assert store.status()["users"][quiet]["measuredAgoS"] >= 1.0  # walked at start-up only
