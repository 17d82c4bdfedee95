"""The egress proxy's DNS threads under a user whose names a dead resolver never answers.

The daemon runs in a network namespace with nothing but loopback, and in a mount namespace whose
/etc/resolv.conf names a nameserver this test runs there, one that reads every query and never
answers (bench/dead_resolver.py). No query can leave the namespace. The bystander's name is in
that namespace's /etc/hosts and resolves to a private address: the policy refuses it after the
lookup, so nothing is ever connected to.
"""

from __future__ import annotations

import json
import statistics
import time
from typing import Any

import pytest

from bench.dead_resolver import DeadResolver
from sandboxd.egress.proxy import LOOKUPS_PER_USER
from tests.e2e.conftest import Daemon
from tests.e2e.neighbours import Background, wait_for_pool

pytestmark = pytest.mark.docker

HOSTILE, BYSTANDER = "dead-names@example.com", "bystander@example.com"
BYSTANDER_NAME = "bystander.test"  # in the namespace's /etc/hosts only
REFUSED = "refused by sandboxd's egress policy: private address (RFC 1918)"
SANDBOXES, LOOPS = 4, 4  # the hostile user's, each with LOOPS requests always waiting on dead names


def bystander_request_seconds(daemon: Daemon, count: int) -> list[float]:
    """``count`` warm calls of the bystander, each one request to a name in /etc/hosts; their times."""
    out = []
    with daemon.client() as client:
        for _ in range(count):
            started = time.perf_counter()
            result = client.call_tool(BYSTANDER, "egress_probe", {"mode": "raw", "request": f"CONNECT {BYSTANDER_NAME}:443 HTTP/1.1\r\n\r\n"},
                                      timeout_ms=60_000)
            elapsed = time.perf_counter() - started
            assert result["status"] == "ok", result
            answer = json.loads(result["content"][0]["text"])["answer"]
            assert REFUSED in answer, f"the bystander's name was not resolved in time: {answer}"
            out.append(elapsed)
    return out


def test_one_users_sandboxes_waiting_on_a_dead_resolver_leave_a_bystanders_lookup_its_own_time(make_daemon: Any, tmp_path: Any) -> None:
    """Four sandboxes of one user keep sixteen CONNECTs to never-answered names going. The proxy
    gives that user two lookups in flight, whatever their number of sandboxes, so the dead resolver
    is asked by two lookups only; the bystander's own lookup finds a free thread and its request
    takes about what it took quiet. Before issue 44 each sandbox had two: the user held all eight
    threads, and the bystander's lookup waited out egress.connect_timeout_ms (504)."""
    resolver = DeadResolver(tmp_path / "resolver", {BYSTANDER_NAME: "10.0.0.5"})
    # connect_rate: the bystander's requests are refusals (5 each of 50 a second), timed here for their lookups.
    daemon = make_daemon(loopback_only=True, binds=resolver.binds, env={"SANDBOXD_EGRESS_CONNECT_RATE": "10000"})
    assert daemon.proc is not None
    resolver.start(daemon.proc.pid)
    background = Background(daemon)
    try:
        bystander_request_seconds(daemon, 2)  # its sandbox warm, the tool loaded
        quiet = statistics.median(bystander_request_seconds(daemon, 5))
        for i in range(SANDBOXES):
            background.call(HOSTILE, "egress_probe", {"mode": "flood", "request": f"CONNECT x{i}.dead.test:443 HTTP/1.1\r\n\r\n",
                                                      "port": LOOPS, "seconds": 600}, timeout_ms=600_000)
        wait_for_pool(daemon, lambda p: p["users"].get(HOSTILE, {}).get("busy", 0) == SANDBOXES, 120,
                      f"{SANDBOXES} sandboxes of one user flooding")
        time.sleep(1)  # every sandbox's requests sent and waiting
        loaded = bystander_request_seconds(daemon, 5)
        asked = resolver.most_in_flight()
    finally:
        resolver.stop()  # its SERVFAILs end the lookups it held, so the daemon stops at once
        background.close()
    print(f"\n[dead resolver] bystander's request quiet {quiet * 1000:.0f} ms, beside the dead names "
          f"{', '.join(f'{s * 1000:.0f}' for s in loaded)} ms; lookups waiting on the resolver at once: {asked}")
    assert asked == LOOKUPS_PER_USER, f"lookups waiting on the dead resolver at once: {asked}"
    # Twice its quiet time, and 0.1 s for a shared machine's scheduler: the failure is connect_timeout_ms, 10 s.
    assert statistics.median(loaded) <= 2 * quiet + 0.1, (loaded, quiet)
