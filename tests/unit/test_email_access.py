"""The email database's access, per sandbox (sandbox/email_access.py): owners, mounts, the pool."""

from __future__ import annotations

import asyncio
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from sandboxd.config import AUTO_SANDBOX_ID, PoolConfig
from sandboxd.container import CONTAINER_EMAIL_DIR
from sandboxd.sandbox.backend import SandboxSpec
from sandboxd.sandbox.email_access import call_owner, likely_owner, owner, owner_access, owner_user
from sandboxd.sandbox.fake import FakeBackend
from sandboxd.sandbox.mounts import sandbox_binds
from sandboxd.sandbox.pool import Pool
from sandboxd.tools.permissions import NOTHING, UNDECLARED, Permissions
from tests.unit.test_mounts import ALICE, make_db, spec

A = "a@x.io"


@pytest.mark.parametrize("access", ["none", "read", "write"])
def test_an_owner_names_its_user_and_access(access: Any) -> None:
    key = owner(A, access)
    assert owner_user(key) == A and owner_access(key) == access


def test_write_is_the_user_alone_so_undeclared_tools_keep_todays_sandboxes() -> None:
    assert owner(A, "write") == A
    assert call_owner(A, UNDECLARED, required=False) == A
    assert call_owner(A, Permissions(email="write", declared=True), required=False) == A


def test_a_declared_block_or_the_operators_requirement_picks_the_sandbox() -> None:
    assert call_owner(A, Permissions(email="read", declared=True), required=False) == owner(A, "read")
    assert call_owner(A, Permissions(declared=True), required=False) == owner(A, "none")  # email left out
    assert call_owner(A, UNDECLARED, required=True) == owner(A, "none")  # tools.require_permissions
    assert call_owner(A, NOTHING, required=False) == owner(A, "none")


def test_an_owner_with_an_unknown_access_is_refused() -> None:
    with pytest.raises(ValueError, match="names no email access"):
        owner_access(A + " email:all")


@pytest.mark.parametrize(("access", "mounted"), [("write", False), ("read", True), ("none", None)])
def test_the_email_folder_is_mounted_as_the_access_says(tmp_path: Path, access: Any, mounted: bool | None) -> None:
    make_db(tmp_path / "email" / ALICE / "emails.db")
    binds, _ = sandbox_binds(replace(spec(tmp_path, ALICE), email_access=access), AUTO_SANDBOX_ID)
    email = [bind for bind in binds if bind.target == CONTAINER_EMAIL_DIR]
    if mounted is None:
        assert email == []
    else:
        assert [bind.read_only for bind in email] == [mounted]


def test_the_pool_never_hands_a_sandbox_of_one_access_to_a_call_of_another() -> None:
    started: list[str] = []

    def spec_for(key: str) -> SandboxSpec:
        started.append(key)
        return _spec_for(key)

    async def main() -> None:
        # Room for both (max_per_user counts them together; test_pool_accounts.py: one gives way to the other).
        pool = Pool(FakeBackend(), PoolConfig(max_per_user=2, max_total=4, min_idle=0, acquire_timeout_ms=500), spec_for)
        writer = await pool.acquire(owner(A, "write"))
        pool.release(writer, reusable=True)
        await asyncio.sleep(0)
        nothing = await pool.acquire(owner(A, "none"))  # the write sandbox is idle, and not handed out
        assert nothing is not writer and nothing.sandbox is not writer.sandbox
        pool.release(nothing, reusable=True)
        again = await pool.acquire(owner(A, "write"))
        assert again is writer  # each access keeps its own warm sandbox
        pool.release(again, reusable=True)
        # Status and the disk quota see one user, whatever their sandboxes carry.
        assert list(pool.status()["users"]) == [A]
        assert sorted(pool.retire(A)) == sorted([writer.id, nothing.id])

    asyncio.run(main())
    assert started == [A, owner(A, "none")]


def test_a_listing_warms_the_owner_most_tools_need() -> None:
    none, read = Permissions(declared=True), Permissions(email="read", declared=True)
    assert likely_owner(A, [none, read, none, UNDECLARED], required=False) == owner(A, "none")
    assert likely_owner(A, [UNDECLARED, UNDECLARED, read], required=False) == A
    assert likely_owner(A, [UNDECLARED, UNDECLARED, read], required=True) == owner(A, "none")
    assert likely_owner(A, [], required=False) == A


def test_retiring_a_user_replaces_their_sandboxes_of_another_access_at_once() -> None:
    async def main() -> None:
        pool = Pool(FakeBackend(), PoolConfig(max_per_user=1, max_total=4, min_idle=0), _spec_for)
        nothing = await pool.acquire(owner(A, "none"))  # the user's only sandbox: no email
        pool.release(nothing, reusable=True)
        await asyncio.sleep(0)
        assert pool.retire(A) == [nothing.id]
        assert pool.status()["users"][A]["stopping"] == 1  # now, not at the next maintenance

    asyncio.run(main())


def _spec_for(key: str) -> SandboxSpec:
    root = Path("/nonexistent")
    return SandboxSpec(owner_user(key), root / "tools", root / "u", root / "u" / "tools", None,
                       email_access=owner_access(key))
