"""A move's pure parts: the steps and their undoing (cluster/move.py) against an in-memory directory and hosts,
a draining host's gate, and a moved copy set aside and removed (storage/moved.py)."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path
from typing import Any

import pytest

from sandboxd.cluster.directory import Snapshot
from sandboxd.cluster.move import MoveFailed, move, plan
from sandboxd.cluster.records import CLAIM, NodeRecord, UserRecord, decide
from sandboxd.cluster.rendezvous import place
from sandboxd.config import Config, StorageConfig
from sandboxd.storage import moved
from sandboxd.wire import RpcError

U = "alice@example.com"
NODES = {"a": NodeRecord("a", "127.0.0.1:1"), "b": NodeRecord("b", "127.0.0.1:2"),
         "c": NodeRecord("c", "127.0.0.1:3", "draining")}


class Store:
    """The directory's user records with etcd's compare-the-epoch transactions, in memory."""

    def __init__(self, record: UserRecord) -> None:
        self.record: UserRecord | None = record
        self.revision = record.epoch

    async def snapshot(self) -> Snapshot:
        return Snapshot(self.revision, dict(NODES), {U: self.record} if self.record else {})

    async def replace(self, old: UserRecord, new: UserRecord) -> UserRecord | None:
        if self.record is None or self.record.epoch != old.epoch:
            return None
        self.revision += 1
        self.record = UserRecord(new.user, new.node, self.revision, new.state, new.to)
        return self.record

    async def mark_moving(self, record: UserRecord, to: str) -> UserRecord | None:
        return await self.replace(record, UserRecord(record.user, record.node, 0, "moving", to))

    async def flip(self, record: UserRecord) -> UserRecord | None:
        return await self.replace(record, UserRecord(record.user, str(record.to), 0))

    async def abort(self, record: UserRecord) -> UserRecord | None:
        return await self.replace(record, UserRecord(record.user, record.node, 0))


class Hosts:
    """The hosts' answers by method; a method in ``refuse`` answers an error. Every call is kept."""

    def __init__(self, refuse: dict[str, str] | None = None) -> None:
        self.refuse = refuse or {}
        self.calls: list[tuple[str, str]] = []

    async def dial(self, _address: str, node: str) -> Any:
        hosts = self

        class Client:
            async def call(self, method: str, params: dict[str, Any]) -> Any:
                hosts.calls.append((node, method))
                if method in hosts.refuse:
                    raise RpcError(-32602, hosts.refuse[method])
                return {"files": 3, "bytes": 30} if method == "users/pull" else {}

            async def close(self) -> None:
                pass

        return Client()


def run_move(store: Store, hosts: Hosts, to: str = "b") -> Any:
    return asyncio.run(move(store, hosts.dial, U, to, wait_s=1))  # type: ignore[arg-type]


def test_a_move_marks_pulls_on_the_target_checks_the_source_then_flips_at_a_higher_epoch() -> None:
    store, hosts = Store(UserRecord(U, "a", 5)), Hosts()
    done = run_move(store, hosts)
    assert hosts.calls == [("b", "users/pull"), ("a", "users/move_check")]
    assert store.record == UserRecord(U, "b", 7) and done.epoch == 7 and (done.files, done.bytes) == (3, 30)


@pytest.mark.parametrize("method, step", [("users/pull", "pull"), ("users/move_check", "check")])
def test_a_failed_step_puts_the_user_back_active_on_the_source_and_names_the_step(method: str, step: str) -> None:
    store, hosts = Store(UserRecord(U, "a", 5)), Hosts({method: "it went wrong"})
    with pytest.raises(MoveFailed) as failed:
        run_move(store, hosts)
    assert failed.value.step == step and "it went wrong" in failed.value.message
    assert "active on a again" in failed.value.message
    assert store.record is not None and (store.record.node, store.record.state) == ("a", "active")
    # An import the target made is discarded; a refused pull left none (and may have refused data it must keep).
    assert (("b", "users/discard") in hosts.calls) == (step == "check")


def test_a_record_changed_before_the_flip_fails_at_flip_and_leaves_it_alone() -> None:
    store, hosts = Store(UserRecord(U, "a", 5)), Hosts()
    original = store.flip

    async def changed_first(record: UserRecord) -> UserRecord | None:
        store.revision += 1  # an operator's --abort, say, wrote meanwhile
        store.record = UserRecord(U, "a", store.revision)
        return await original(record)

    store.flip = changed_first  # type: ignore[method-assign]
    with pytest.raises(MoveFailed) as failed:
        run_move(store, hosts)
    assert failed.value.step == "flip" and store.record == UserRecord(U, "a", 7)


@pytest.mark.parametrize("record, to, why", [
    (None, "b", "no home host yet"),
    (UserRecord(U, "a", 5, "moving", "b"), "b", "being moved to b already"),
    (UserRecord(U, "b", 5), "b", "lives on b already"),
    (UserRecord(U, "a", 5), "z", "host z is not registered"),
    (UserRecord(U, "a", 5), "c", "host c is draining"),
    (UserRecord(U, "z", 5), "b", "host z is down"),
])
def test_a_move_that_cannot_start_changes_nothing(record: UserRecord | None, to: str, why: str) -> None:
    with pytest.raises(MoveFailed) as failed:
        plan(Snapshot(1, dict(NODES), {U: record} if record else {}), U, to)
    assert failed.value.step == "plan" and why in failed.value.message and "Nothing was changed" in failed.value.message


def test_a_draining_host_sends_a_new_user_where_rendezvous_places_them_and_serves_its_own() -> None:
    refused, home = decide(U, None, NODES, "c", False), place(U, ["a", "b"])
    assert not isinstance(refused, (int, str)) and home is not None
    assert refused.data == {"reason": "elsewhere", "node": home, "address": NODES[home].address}
    assert decide(U, UserRecord(U, "c", 9), NODES, "c", False) == 9
    alone = {"c": NodeRecord("c", None, "draining")}
    assert decide(U, None, alone, "c", False) == CLAIM  # no other host takes new users: it serves them
    assert decide(U, None, NODES, "a", False) == CLAIM


def test_a_moved_copy_is_set_aside_read_only_and_removed_once_kept_long_enough(tmp_path: Path) -> None:
    config = Config(data_path=tmp_path, storage=StorageConfig(enforcement="soft"))
    (tmp_path / U / "tools").mkdir(parents=True)
    (tmp_path / U / "f").write_text("x")
    (tmp_path / "email" / U).mkdir(parents=True)
    aside = moved.set_aside(config, U, now=1000)
    assert aside == [tmp_path / f"{U}~sandboxd-moved-1000", tmp_path / "email" / f"{U}~sandboxd-moved-1000"]
    assert not (tmp_path / U).exists() and (aside[0] / "f").read_text() == "x"
    assert os.stat(aside[0]).st_mode & 0o222 == 0
    assert moved.remove_expired(config, 100, now=1099) == []
    assert sorted(moved.remove_expired(config, 100, now=1100)) == sorted(aside)
    assert not any(path.exists() for path in aside)
    assert moved.set_aside_at(f"{U}~sandboxd-moved-12x") is None and moved.set_aside_at(U) is None


class Fleet:
    """Several users' records and the hosts' drain marks, in memory, for a drain (moves always succeed)."""

    def __init__(self, homes: dict[str, str], nodes: dict[str, NodeRecord]) -> None:
        self.users = {user: UserRecord(user, node, 1) for user, node in homes.items()}
        self.nodes = dict(nodes)

    async def snapshot(self) -> Snapshot:
        return Snapshot(1, dict(self.nodes), dict(self.users))

    async def set_draining(self, name: str, draining: bool) -> NodeRecord | None:
        old = self.nodes[name]
        self.nodes[name] = NodeRecord(name, old.address, "draining" if draining else "active")
        return self.nodes[name]


def test_a_drain_marks_the_host_and_moves_each_user_where_rendezvous_places_them_among_the_active_hosts(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from sandboxd.cluster import drain as drain_module

    users = [f"u{i}@example.com" for i in range(6)]
    fleet = Fleet({user: "a" for user in users} | {"other@example.com": "b"},
                  {"a": NodeRecord("a", "x:1"), "b": NodeRecord("b", "x:2"), "c": NodeRecord("c", "x:3"),
                   "d": NodeRecord("d", "x:4", "draining")})

    async def fake_move(directory: Fleet, _dial: Any, user: str, to: str, *, wait_s: float) -> Any:
        if user == users[0]:
            raise MoveFailed(user, "pull", "refused", "It stays.")
        directory.users[user] = UserRecord(user, to, 2)
        return type("Moved", (), {"to_json": lambda self: {"user": user, "to": to}})()

    monkeypatch.setattr(drain_module, "move", fake_move)
    told: list[dict[str, Any]] = []
    failed = asyncio.run(drain_module.drain(fleet, Hosts().dial, "a", wait_s=1, told=told.append))  # type: ignore[arg-type]
    assert fleet.nodes["a"].state == "draining" and failed == [users[0]]
    assert [line["user"] for line in told] == users  # one line each, in order, the failure included
    for user in users[1:]:
        assert fleet.users[user].node == place(user, ["b", "c"])  # never the draining d, nor a
    assert fleet.users["other@example.com"].node == "b"
