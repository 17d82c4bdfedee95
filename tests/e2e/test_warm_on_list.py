"""tools/list with a user warms that user's pool (a pi session's start), on real Docker.

A client may list for any number of users: a warm-up never evicts another user's
sandbox, so listing cannot push a working user out of a full pool; a real call still can.
"""

from __future__ import annotations

from typing import Any

import pytest

from tests.e2e.hostile_harness import wait_until

pytestmark = pytest.mark.docker

A, B = "alice@example.com", "bob@example.com"


def users(client: Any) -> dict[str, dict[str, int]]:
    return client.request("sandbox/status")["pool"]["users"]


def test_listing_warms_and_never_evicts_but_a_call_still_can(make_daemon: Any) -> None:
    daemon = make_daemon("pool:\n  max_total: 1\n  min_idle: 1\n")
    with daemon.client() as client:
        client.request("tools/list")  # no user: nobody is warmed
        assert users(client) == {}
        client.request("tools/list", {"user": A})
        wait_until(lambda: users(client).get(A, {}).get("idle") == 1, 60, "alice's warm sandbox")
        # The pool is full: bob's session start warms nothing and alice keeps her sandbox.
        client.request("tools/list", {"user": B})
        assert B not in users(client)  # the warm-up ran before the answer: it started nothing
        assert users(client)[A]["idle"] == 1
        # Bob's first call is a caller: it may take the room (alice's idle sandbox goes).
        assert client.call_tool(B, "hello", {"name": "Bob"})["status"] == "ok"
        wait_until(lambda: A not in users(client) or users(client)[A]["idle"] == 0, 60, "alice's sandbox evicted")
