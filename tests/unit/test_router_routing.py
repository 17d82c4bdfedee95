"""The router's routing decision, from a view of the directory (no etcd): where a call goes, or why not."""

from __future__ import annotations

from sandboxd.cluster.records import UserRecord
from sandboxd.router.routing import decide, refusal_of
from sandboxd.wire import error_object, error_response, response
from tests.unit.router_view import View

USERS = [f"user{i}@example.com" for i in range(30)]


def test_a_user_with_a_home_goes_there() -> None:
    view = View({"a": "active", "b": "draining"}, {"u@x.io": UserRecord("u@x.io", "b", 5)})
    assert decide("u@x.io", view)[:3] == ("forward", "b", "b.test:7443")  # draining hosts still serve their own


def test_a_user_being_moved_waits() -> None:
    view = View({"a": "active", "b": "active"}, {"u@x.io": UserRecord("u@x.io", "a", 5, "moving", "b")})
    assert decide("u@x.io", view).action == "wait"


def test_a_user_whose_host_is_gone_is_refused_node_down_at_once() -> None:
    view = View({"a": "active"}, {"u@x.io": UserRecord("u@x.io", "b", 5)})
    decision = decide("u@x.io", view)
    assert decision.action == "refuse" and decision.refusal is not None
    assert decision.refusal.code == -32005 and decision.refusal.data == {"reason": "node_down", "node": "b"}


def test_a_new_user_is_placed_on_an_active_host_only() -> None:
    view = View({"a": "draining", "b": "active", "c": "draining"})
    assert {decide(user, view)[:2] for user in USERS[:30]} == {("place", "b")}
    assert decide("u@x.io", View({"a": "draining"})).action == "refuse"


def test_only_a_hosts_refusal_is_read_as_one() -> None:
    refused = error_response(3, error_object(-32005, "elsewhere", {"reason": "elsewhere", "node": "b"}))
    assert refusal_of(dict(refused)) == ("elsewhere", {"reason": "elsewhere", "node": "b"})
    assert refusal_of(dict(error_response(3, error_object(-32602, "bad")))) is None
    assert refusal_of(dict(error_response(3, error_object(-32005, "no data")))) is None
    assert refusal_of(dict(response(3, {"status": "ok"}))) is None
