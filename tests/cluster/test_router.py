"""`sandboxd router` end to end (issue 47, item 1): a real etcd, two real daemons with mutual-TLS listeners
(node:a, node:b), one router process (router:r1) in front of them, real tools through Docker.

One fleet serves the module (~40 s, most of it the first sandboxes and the killed host's lease); the
killed host's test runs last. The router reads etcd through a relay the stale-view test can freeze.
"""

from __future__ import annotations

import asyncio
import json
import signal
import time
from pathlib import Path
from typing import Any, Iterator

import pytest

from sandboxd.async_client import AsyncClient
from sandboxd.client import Client
from sandboxd.cluster.rendezvous import place
from sandboxd.wire import RpcError, cancelled, request
from tests.cluster.certs import ClusterCerts, make_certs
from tests.cluster.etcd import Etcd
from tests.cluster.router import FreezableLink, Router, etcd_target, start_host
from tests.e2e.conftest import Daemon, docker_api  # noqa: F401  (a fixture)

pytestmark = pytest.mark.docker

LEASE_S = 2
USERS = [f"u{i}@example.com" for i in range(9)]  # rendezvous puts some on each host (tests/unit/test_router.py)


class Fleet:
    def __init__(self, etcd: Etcd, hosts: dict[str, Daemon], router: Router, link: FreezableLink) -> None:
        self.etcd, self.hosts, self.router, self.link = etcd, hosts, router, link

    def home(self, user: str) -> str | None:
        got = self.etcd.ctl("get", "--print-value-only", f"/sandboxd/users/{user}").stdout.strip()
        return json.loads(got)["node"] if got else None


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> ClusterCerts:
    return make_certs(tmp_path_factory.mktemp("certs"))


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory, certs: ClusterCerts, docker_api: Any) -> Iterator[Fleet]:  # noqa: F811
    tmp = tmp_path_factory.mktemp("fleet")
    etcd = Etcd().start()
    link = FreezableLink(etcd_target(etcd))
    hosts: dict[str, Daemon] = {}
    router = Router(tmp, link.url, certs.router)
    try:
        hosts["a"] = start_host(tmp, "a", etcd.url, certs.node_a, lease_s=LEASE_S)
        hosts["b"] = start_host(tmp, "b", etcd.url, certs.node_b, lease_s=LEASE_S)
        yield Fleet(etcd, hosts, router.start(), link)
    finally:
        router.stop()
        for host in hosts.values():
            if host.proc is not None and host.proc.poll() is None:
                host.stop()
                host.remove_leftovers(docker_api)
            else:  # killed by its test: what it left is the next start's orphans; removed here instead
                for container in host.containers(docker_api):
                    docker_api.api.remove_container(container["Id"], force=True)
        link.close()
        etcd.stop()


def call(client: Client, user: str, name: str = "progress", **arguments: Any) -> Any:
    return client.request("tools/call", {"user": user, "name": name, "arguments": arguments or {"steps": 0}})


async def call_all(socket: Path, users: list[str]) -> list[Any]:
    client = await AsyncClient.connect(socket)
    try:
        return await asyncio.gather(*(client.call("tools/call", {"user": user, "name": "progress",
                                                                 "arguments": {"steps": 0}}) for user in users))
    finally:
        await client.close()


def pooled_users(status: dict[str, Any], node: str) -> set[str]:
    return set(status["hosts"][node]["pool"]["users"])


def test_nine_users_are_spread_over_the_hosts_and_each_answered(fleet: Fleet) -> None:
    results = asyncio.run(call_all(fleet.router.socket, USERS))
    assert [result["status"] for result in results] == ["ok"] * 9
    homes = {user: fleet.home(user) for user in USERS}
    # Placed as rendezvous hashing says (the claim's record in etcd), and on both hosts.
    assert homes == {user: place(user, ["a", "b"]) for user in USERS}
    assert set(homes.values()) == {"a", "b"}
    with fleet.router.client() as client:
        status = client.request("sandbox/status")
    assert status["unanswered"] == [] and set(status["hosts"]) == {"a", "b"}
    for user, home in homes.items():  # each user's sandbox is on their home host, and only there
        other = "b" if home == "a" else "a"
        assert user in pooled_users(status, home) and user not in pooled_users(status, other)
    with fleet.router.client() as client:
        pinged = client.request("ping")
    assert set(pinged["hosts"]) == {"a", "b"} and pinged["unanswered"] == []


def test_progress_streams_and_a_cancel_pass_through(fleet: Fleet) -> None:
    user = USERS[0]
    first, second = fleet.router.client(), fleet.router.client()
    try:
        # Two clients, the same id and the same token, on the router's shared host connections: each hears its own.
        for client, steps in ((first, 3), (second, 2)):
            client.send(request("p", "tools/call", {"user": user, "name": "progress", "arguments": {"steps": steps},
                                                     "_meta": {"progressToken": "mine"}}))
        for client, steps in ((first, 3), (second, 2)):
            heard = []
            while "id" not in (message := client.read_message()):
                heard.append((message["params"]["progressToken"], message["params"]["progress"]))
            assert message["id"] == "p" and message["result"]["status"] == "ok"
            assert heard == [("mine", count) for count in range(1, steps + 1)]
        # A cancel reaches the tool: announcer says "running", then sleeps until its AbortSignal fires.
        first.send(request(9, "tools/call", {"user": user, "name": "announcer", "arguments": {"ms": 60_000}}))
        assert first.read_message()["method"] == "notifications/progress"  # running, under the request's id
        started = time.monotonic()
        first.send(cancelled(9, "the test changed its mind"))
        answer = first.read_message()
        assert answer["id"] == 9 and answer["result"]["status"] == "cancelled"
        assert time.monotonic() - started < 10  # the AbortSignal, not the 60-s sleep (nor the deadline)
    finally:
        first.close()
        second.close()


def test_a_stale_views_elsewhere_is_retried_once_at_the_named_host(fleet: Fleet) -> None:
    user = "stale@example.com"
    with fleet.router.client() as client:
        assert call(client, user)["status"] == "ok"
    home = fleet.home(user)
    assert home is not None
    other = "b" if home == "a" else "a"
    fleet.link.freeze()  # the router's watch hears nothing from here on
    try:
        # What a finished move leaves: the record names the other host, at a higher epoch.
        fleet.etcd.ctl("put", f"/sandboxd/users/{user}", json.dumps({"node": other, "state": "active"}))
        with fleet.hosts[home].client() as direct:  # the old home's own view has the change: it refuses
            deadline = time.monotonic() + 5
            while True:
                try:
                    call(direct, user)
                except RpcError as refused:
                    assert refused.data["reason"] == "elsewhere" and refused.data["node"] == other
                    break
                assert time.monotonic() < deadline, "the old home never saw the record change"
                time.sleep(0.1)
        with fleet.router.client() as client:  # the router still sends it to the old home, which says elsewhere
            assert call(client, user)["status"] == "ok"
            status = client.request("sandbox/status")
        assert user in pooled_users(status, other)
    finally:
        fleet.link.thaw()


def test_a_killed_hosts_users_get_node_down_while_the_others_are_served(fleet: Fleet) -> None:
    on_a = [user for user in USERS if fleet.home(user) == "a"]
    on_b = [user for user in USERS if fleet.home(user) == "b"]
    assert on_a and on_b
    with fleet.router.client() as client:
        quiet = []
        for user in on_a * 2:  # the quiet baseline, sandboxes warm
            started = time.monotonic()
            assert call(client, user)["status"] == "ok"
            quiet.append(time.monotonic() - started)
        host_b = fleet.hosts["b"]
        assert host_b.proc is not None
        host_b.proc.send_signal(signal.SIGKILL)
        killed = time.monotonic()
        others: list[float] = []
        refusal = None
        while refusal is None and time.monotonic() - killed < LEASE_S + 5:
            try:
                call(client, on_b[0])
            except RpcError as error:  # until the lease expires: the host cannot be reached (-32002)
                if error.code == -32005:
                    refusal = error
            for user in on_a:
                started = time.monotonic()
                assert call(client, user)["status"] == "ok"
                others.append(time.monotonic() - started)
            time.sleep(0.1)
        took = time.monotonic() - killed
    assert refusal is not None and refusal.data == {"reason": "node_down", "node": "b"}, fleet.router.log()
    assert took <= LEASE_S + 1, f"node_down after {took:.1f} s"
    assert max(others) <= max(10 * max(quiet), 1.0), (quiet, others)  # the other host's users never noticed
