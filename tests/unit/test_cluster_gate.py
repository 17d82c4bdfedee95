"""The directory's pure parts (issue 46): the gate's decision, the fence's clock, the records, the view's changes."""

from __future__ import annotations

from pathlib import Path

import pytest

from sandboxd.cluster.directory import Change, Directory, Snapshot, endpoints
from sandboxd.cluster.membership import Fence
from sandboxd.cluster.records import CLAIM, BadRecord, NodeRecord, UserRecord, decide
from sandboxd.cluster.view import DirectoryView
from sandboxd.config.cluster import ClusterConfig
from sandboxd.errors import ConfigError, NotServedHere
from tests.unit.test_server import Harness, ok_handler, serving

U = "alice@example.com"
NODES = {"a": NodeRecord("a", "10.0.0.1:7443"), "b": NodeRecord("b", "10.0.0.2:7443")}


def test_a_user_of_this_host_is_served_at_their_epoch() -> None:
    assert decide(U, UserRecord(U, "a", 7), NODES, "a", False) == 7


def test_a_user_with_no_record_is_claimed() -> None:
    assert decide(U, None, NODES, "a", False) == CLAIM


def test_a_user_of_a_live_host_is_refused_elsewhere_with_its_address() -> None:
    refused = decide(U, UserRecord(U, "b", 7), NODES, "a", False)
    assert isinstance(refused, NotServedHere) and refused.code == -32005
    assert refused.data == {"reason": "elsewhere", "node": "b", "address": "10.0.0.2:7443"}
    assert "10.0.0.2:7443" in refused.message


def test_a_user_whose_host_lost_its_lease_is_node_down() -> None:
    refused = decide(U, UserRecord(U, "c", 7), NODES, "a", False)
    assert isinstance(refused, NotServedHere)
    assert refused.data == {"reason": "node_down", "node": "c"}


def test_a_user_being_moved_is_refused_moving_even_on_their_host() -> None:
    refused = decide(U, UserRecord(U, "a", 7, "moving", "b"), NODES, "a", False)
    assert isinstance(refused, NotServedHere)
    assert refused.data["reason"] == "moving" and refused.data["retry_after_ms"] > 0


@pytest.mark.parametrize("record", [None, UserRecord(U, "a", 7), UserRecord(U, "b", 7)])
def test_a_fenced_host_refuses_every_call_first(record: UserRecord | None) -> None:
    refused = decide(U, record, NODES, "a", True)
    assert isinstance(refused, NotServedHere) and refused.data == {"reason": "fenced"}


def test_records_round_trip_and_bad_values_are_refused() -> None:
    record = UserRecord(U, "a", 0, "moving", "b")
    assert UserRecord.load(U, record.dump(), 9) == UserRecord(U, "a", 9, "moving", "b")
    rehomed = UserRecord(U, "b", 0, left="a")
    assert UserRecord.load(U, rehomed.dump(), 4) == UserRecord(U, "b", 4, left="a")
    assert rehomed.to_json()["left"] == "a" and "left" not in record.to_json()
    assert NodeRecord.load("a", NODES["a"].dump()) == NODES["a"]
    for value in (b"[]", b"{", b'{"node": 3}', b'{"node": "a", "state": "gone"}', b'{"node": "a", "left": 1}'):
        with pytest.raises(BadRecord):
            UserRecord.load(U, value, 1)


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_the_fence_counts_from_the_renewal_sent_and_stays_until_cleared() -> None:
    clock = Clock()
    fence = Fence(5, clock)
    clock.now = 103.0
    fence.renewed(sent_at=102.0)  # answered later; the lease counts from the send
    clock.now = 106.9
    assert not fence.fenced
    clock.now = 107.0
    assert fence.fenced
    fence.renewed(sent_at=107.0)  # an old lease renewed late does not lift it
    assert fence.fenced
    fence.cleared(registered_at=108.0)
    assert not fence.fenced


def test_a_lease_etcd_let_expire_fences_at_once() -> None:
    fence = Fence(5, Clock())
    fence.lost()
    assert fence.fenced


def test_etcd_endpoints_are_http_host_port() -> None:
    assert endpoints(["http://127.0.0.1:2379", "10.0.0.5:2379"]) == [("127.0.0.1", 2379), ("10.0.0.5", 2379)]
    for bad in ("https://10.0.0.5:2379", "http://10.0.0.5", "http://:2379"):
        with pytest.raises(ConfigError, match="http://HOST:PORT"):
            endpoints([bad])


def _view(seen: list[tuple[str, str | None, str | None]]) -> DirectoryView:
    cluster = ClusterConfig(node="a", etcd=["http://127.0.0.1:1"], tls={"cert": "c", "key": "k", "ca": "ca"})
    return DirectoryView(Directory(cluster), on_user=lambda user, old, new: seen.append(
        (user, old and old.node, new and new.node)))


def test_the_view_follows_changes_and_tells_who_left() -> None:
    seen: list[tuple[str, str | None, str | None]] = []
    view = _view(seen)
    view.load(Snapshot(10, dict(NODES), {U: UserRecord(U, "a", 8)}))
    assert view.home(U) == UserRecord(U, "a", 8) and seen == [(U, None, "a")]
    view.apply(Change(b"/sandboxd/users/" + U.encode(), b'{"node": "b", "state": "active"}', 9))
    assert view.home(U).node == "a", "a change the read already holds is not applied again"
    view.apply(Change(b"/sandboxd/users/" + U.encode(), b'{"node": "b", "state": "active"}', 11))
    assert view.home(U) == UserRecord(U, "b", 11) and seen[-1] == (U, "a", "b")
    view.apply(Change(b"/sandboxd/nodes/b", None, 12))  # b's lease expired
    assert view.node("b") is None and set(view.nodes()) == {"a"} and view.revision == 12


def test_a_claims_answer_and_its_watch_event_are_applied_once() -> None:
    seen: list[tuple[str, str | None, str | None]] = []
    view = _view(seen)
    view.put_user(U, UserRecord(U, "a", 5))  # the transaction's answer, before the watch brings it
    view.apply(Change(b"/sandboxd/users/" + U.encode(), b'{"node": "a", "state": "active"}', 5))
    assert seen == [(U, None, "a")] and view.users_of("a") == [U]


# -- the gate in the call runner (fake backend, a gate that answers as told) ---------------------------


class FakeGate:
    def __init__(self, verdict: int | None | NotServedHere) -> None:
        self.verdict = verdict
        self.claims: list[str] = []
        self.calls_served: list[tuple[str, int]] = []

    def admit(self, user: str) -> int | None:
        if isinstance(self.verdict, NotServedHere):
            raise self.verdict
        return self.verdict

    async def claim(self, user: str) -> int:
        self.claims.append(user)
        return 9

    def served(self, user: str, epoch: int, start: float) -> None:
        self.calls_served.append((user, epoch))


def test_a_refused_call_takes_no_sandbox_and_is_counted(tmp_path: Path) -> None:
    gate = FakeGate(NotServedHere("elsewhere", "served by b", node="b", address="10.0.0.2:7443"))

    @serving(tmp_path, ok_handler, pool={"min_idle": 0})
    async def _(h: Harness) -> None:
        h.server.runner.gate = gate
        conn = await h.connect()
        reply = await conn.request("tools/call", {"user": U, "name": "hello", "arguments": {"name": "W"}})
        assert reply["error"] == {"code": -32005, "message": "served by b",
                                  "data": {"reason": "elsewhere", "node": "b", "address": "10.0.0.2:7443"}}
        assert h.backend.starts == 0 and gate.calls_served == []
        status = (await conn.request("sandbox/status", request_id=2))["result"]
        assert status["calls"] == {"not_served": 1}


def test_a_user_with_no_record_is_claimed_then_served_at_the_claimed_epoch(tmp_path: Path) -> None:
    gate = FakeGate(None)

    @serving(tmp_path, ok_handler)
    async def _(h: Harness) -> None:
        h.server.runner.gate = gate
        conn = await h.connect()
        reply = await conn.request("tools/call", {"user": U, "name": "hello", "arguments": {"name": "W"}})
        assert reply["result"]["status"] == "ok"
        assert gate.claims == [U] and gate.calls_served == [(U, 9)]
