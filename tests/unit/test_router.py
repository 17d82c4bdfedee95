"""The router's pure parts: rendezvous placement, one upstream connection's ids, the watches it holds."""

from __future__ import annotations

import collections

from sandboxd.cluster.rendezvous import place
from sandboxd.errors import InvalidParams
from sandboxd.router.ids import Slot, UpstreamIds, client_token, with_token
from sandboxd.router.watch import Watches
from sandboxd.wire import PROGRESS, TOOLS_LIST_CHANGED, error_object, error_response, notification, response

USERS = [f"user{i}@example.com" for i in range(1000)]


# -- rendezvous -------------------------------------------------------------------------------------


def test_placement_is_stable_and_ignores_the_order_hosts_are_listed_in() -> None:
    for user in USERS[:50]:
        assert place(user, ["a", "b", "c"]) == place(user, ["c", "a", "b"]) == place(user, ("b", "c", "a"))


def test_placement_spreads_users_evenly() -> None:
    counts = collections.Counter(place(user, ["a", "b", "c"]) for user in USERS)
    assert set(counts) == {"a", "b", "c"}
    for count in counts.values():
        assert abs(count - 1000 / 3) <= 0.15 * 1000 / 3, counts


def test_nine_users_reach_every_one_of_three_hosts() -> None:
    # The e2e's nine users (tests/cluster/test_router.py): each of three hosts gets at least one.
    assert {place(f"u{i}@example.com", ["a", "b", "c"]) for i in range(9)} == {"a", "b", "c"}


def test_a_host_leaving_moves_only_its_own_users() -> None:
    before = {user: place(user, ["a", "b", "c"]) for user in USERS}
    after = {user: place(user, ["a", "b"]) for user in USERS}
    moved = [user for user in USERS if before[user] != after[user]]
    assert moved and all(before[user] == "c" for user in moved)


def test_no_host_places_no_one() -> None:
    assert place("alice@example.com", []) is None


# -- one upstream connection's ids -------------------------------------------------------------------


def test_two_clients_with_the_same_id_get_their_own_answers() -> None:
    ids = UpstreamIds()
    first, second = Slot(client_token=1), Slot(client_token=1)
    a, b = ids.open(first), ids.open(second)
    assert a != b
    step = ids.received(response(b, {"status": "ok"}))
    assert (step.action, step.slot) == ("answer", second)
    step = ids.received(error_response(a, error_object(-32602, "bad")))
    assert (step.action, step.slot) == ("answer", first)
    assert len(ids) == 0


def test_progress_goes_to_its_call_under_the_clients_token() -> None:
    ids = UpstreamIds()
    slot = Slot(on_progress=lambda _params: None, client_token="t1")
    upstream_id = ids.open(slot)
    step = ids.received(notification(PROGRESS, {"progressToken": upstream_id, "progress": 2, "content": []}))
    assert step.action == "progress" and step.slot is slot
    assert step.message == {"progressToken": "t1", "progress": 2, "content": []}
    # Another call's token, or one of a call answered already, reaches no one.
    assert ids.received(notification(PROGRESS, {"progressToken": upstream_id + 1, "progress": 1})).action == "drop"


def test_a_closed_slot_drops_its_late_answer_and_frees_its_place() -> None:
    ids = UpstreamIds()
    upstream_id = ids.open(Slot())
    assert ids.close(upstream_id) is not None
    assert len(ids) == 0
    assert ids.received(response(upstream_id, {})).action == "drop"


def test_a_lost_connection_hands_back_every_slot_once() -> None:
    ids = UpstreamIds()
    slots = [Slot(), Slot()]
    for slot in slots:
        ids.open(slot)
    assert ids.lost() == slots
    assert ids.lost() == [] and len(ids) == 0


def test_other_notifications_are_passed_on() -> None:
    step = UpstreamIds().received(notification(TOOLS_LIST_CHANGED, {"user": "alice@example.com"}))
    assert step.action == "notify"


def test_the_progress_token_is_rewritten_and_read_back() -> None:
    assert with_token({"user": "u@x.io"}, 7) == {"user": "u@x.io", "_meta": {"progressToken": 7}}
    assert with_token({"_meta": {"progressToken": "t", "other": 1}}, 7) == {"_meta": {"progressToken": 7, "other": 1}}
    # What the host would refuse is sent as it came, so the host refuses it as it would directly.
    assert with_token({"_meta": "nope"}, 7) is None
    assert with_token({"_meta": {"progressToken": [1]}}, 7) is None
    assert client_token({"_meta": {"progressToken": "t"}}, 5) == "t"
    assert client_token({}, 5) == 5


# -- tools/watch, held by the router -----------------------------------------------------------------



def test_a_users_watch_is_sent_to_a_host_once_and_heard_by_every_watcher() -> None:
    watches, first, second = Watches(), [], []
    assert watches.add("c1", first.append, "u@x.io") is True  # the first watcher: the router asks the host
    watches.held("u@x.io", "a", "conn-1")
    assert watches.add("c2", second.append, "u@x.io") is False  # the host watches already
    watches.changed("a", {"user": "u@x.io"})
    assert first == second == [dict(notification(TOOLS_LIST_CHANGED, {"user": "u@x.io"}))]
    watches.changed("b", {"user": "u@x.io"})  # a host that does not hold the watch (the user moved) is not heard
    assert len(first) == 1
    watches.forget("c1")
    watches.changed("a", {"user": "u@x.io"})
    assert len(first) == 1 and len(second) == 2


def test_a_lost_host_connection_tells_the_watchers_and_names_what_to_watch_again() -> None:
    watches, heard = Watches(), []
    watches.add("c1", heard.append, "u@x.io")
    watches.held("u@x.io", "a", "conn-1")
    watches.add("c1", heard.append, None)
    watches.held(None, "b", "conn-2")
    assert watches.lost("conn-1") == ["u@x.io"]
    assert heard == [dict(notification(TOOLS_LIST_CHANGED, {"user": "u@x.io"}))]  # list again: a change may be lost
    assert watches.add("c2", heard.append, "u@x.io") is True  # no host holds it now


def test_a_client_connection_watches_sixteen_users_at_most() -> None:
    watches = Watches()
    for i in range(16):
        watches.add("c1", lambda _m: None, f"u{i}@x.io")
    try:
        watches.add("c1", lambda _m: None, "one-more@x.io")
    except InvalidParams as exc:
        assert "at most 16" in exc.message
    else:
        raise AssertionError("a 17th user was watched")
    watches.add("c1", lambda _m: None, "u3@x.io")  # one it watches already is fine
