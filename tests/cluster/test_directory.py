"""The directory end to end (issue 46, items 1-2): a real etcd, real daemons on real Docker.

Two hosts register and `nodes list` shows them; a user is the first asker's, and refused
`elsewhere` on the other host without a sandbox started there; two hosts claiming one new user at
once: exactly one wins; etcd stopped: both fence within lease_s + 1 s and serve again within 5 s
of SIGCONT; a host killed: its users are `node_down` on the other within lease_s + 1 s.
"""

from __future__ import annotations

import itertools
import json
import shutil
import signal
import subprocess
import sys
import threading
import time
from typing import Any

import pytest

from sandboxd.client import RpcError
from tests.cluster.etcd import Etcd
from tests.cluster.hosts import cluster_section
from tests.e2e.conftest import REPO, Daemon
from tests.e2e.hostile_harness import wait_until

pytestmark = pytest.mark.docker

LEASE_S = 2
NO_WARM = "pool:\n  min_idle: 0\n"
ALICE = "alice@example.com"


def hello(host: Daemon, user: str) -> dict[str, Any]:
    with host.client() as client:
        return client.call_tool(user, "hello", {"name": "x"})


def refusal(host: Daemon, user: str) -> dict[str, Any]:
    """The -32005 answer's data for a call of ``user`` on ``host`` (fails if it was served)."""
    with pytest.raises(RpcError) as refused:
        hello(host, user)
    assert refused.value.code == -32005, refused.value
    data = refused.value.data
    assert isinstance(data, dict)
    return data


def sandboxd_cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "sandboxd", *args], capture_output=True, text=True, cwd=REPO,
                          timeout=60)


def test_two_hosts_register_and_a_user_is_served_by_one(make_hosts: Any, docker_api: Any, etcd: Etcd,
                                                        tmp_path: Any) -> None:
    a, b = make_hosts(["a", "b"], lease_s=LEASE_S, config=NO_WARM)
    config = tmp_path / "operator.yaml"
    config.write_text(cluster_section("x", etcd).replace("  node: x\n", ""))
    listed = sandboxd_cli("nodes", "list", "--json", "--config", str(config))
    assert listed.returncode == 0, listed.stderr
    nodes = {node["node"]: node for node in json.loads(listed.stdout)["nodes"]}
    assert {name: node["state"] for name, node in nodes.items()} == {"a": "active", "b": "active"}
    assert nodes["a"]["address"] == "a.test:7443"

    assert hello(a, ALICE)["status"] == "ok"  # first asked: a claims alice
    data = refusal(b, ALICE)
    assert data == {"reason": "elsewhere", "node": "a", "address": "a.test:7443"}
    assert not b.containers(docker_api), "b started a sandbox for a call it refused"
    assert hello(a, ALICE)["status"] == "ok"
    with b.client() as client:
        status = client.request("sandbox/status")
    assert status["cluster"] == {"node": "b", "state": "active", "address": "b.test:7443", "fenced": False, "users": 0}
    assert status["calls"].get("not_served") == 1

    where = sandboxd_cli("users", "where", ALICE, "--json", "--config", str(config))
    assert where.returncode == 0, where.stderr
    assert json.loads(where.stdout)["node"] == "a"
    wait_until(lambda: sum(event["calls"] for event in a.events("call_served", user=ALICE)) == 2, 5,
               "a's call_served lines for both calls (logged each second)")
    assert {event["epoch"] for event in a.events("call_served")} == {json.loads(where.stdout)["epoch"]}
    assert not b.events("call_served")


# One sandbox per host, held by a sleeping call: a call past the gate is refused overloaded at once, so
# the race costs no sandbox start (the claim, before the sandbox, is what is raced).
FULL_POOL = ("pool:\n  min_idle: 0\n  max_total: 1\n  reserve: 0\n  acquire_timeout_ms: 50\n  shutdown_grace_s: 0\n"
             "calls:\n  cancel_grace_ms: 0\n")


def test_two_hosts_claiming_one_new_user_at_once_one_wins_every_time(make_hosts: Any, etcd: Etcd) -> None:
    hosts = dict(zip("ab", make_hosts(["a", "b"], lease_s=LEASE_S, config=FULL_POOL)))
    holders = [_hold(name, host) for name, host in hosts.items()]
    try:
        for attempt in range(100):
            _race(hosts, f"new{attempt}@example.com", etcd, attempt)
    finally:
        for holder in holders:
            holder.close()


def _hold(name: str, host: Daemon) -> Any:
    """A client whose sleeping call holds the host's one sandbox. The first call's 50-ms queue ends before the
    sandbox has started (-32001); the sandbox starts on and is idle for the next call, which holds it."""
    holder = host.client(timeout=1)  # the timeout bounds each read of an early answer below
    deadline = time.monotonic() + 60
    for attempt in itertools.count(1):
        holder.send({"jsonrpc": "2.0", "id": attempt, "method": "tools/call",
                     "params": {"user": f"holder-{name}@example.com", "name": "sleeper", "arguments": {"ms": 600_000}}})
        answer = None
        while answer is None and time.monotonic() < deadline:
            try:
                answer = holder.read_message()
            except TimeoutError:  # no answer: a call still queued, or the one that holds the sandbox
                if _calls_in_flight(host) == 1:
                    return holder
        if answer is None or answer.get("error", {}).get("code") != -32001:
            holder.close()
            raise AssertionError(f"{name}'s only sandbox not held within 60 s; the holder's call: {answer}\n"
                                 f"{host.log()}")
        time.sleep(0.2)
    raise AssertionError("unreachable")


def _calls_in_flight(host: Daemon) -> int:
    with host.client() as client:
        return int(client.request("sandbox/status")["callsInFlight"])


def _race(hosts: dict[str, Daemon], user: str, etcd: Etcd, attempt: int) -> None:
    """Both hosts asked for ``user`` at once: one refuses them ``elsewhere``, naming the other, which etcd names."""
    answers: dict[str, RpcError] = {}
    clients = {name: host.client(timeout=30) for name, host in hosts.items()}
    go = threading.Barrier(len(clients))

    def ask(name: str) -> None:
        go.wait()
        try:
            clients[name].call_tool(user, "hello", {"name": "x"})
        except RpcError as exc:
            answers[name] = exc

    threads = [threading.Thread(target=ask, args=(name,)) for name in clients]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    for client in clients.values():
        client.close()
    refused = {name: answer.data for name, answer in answers.items() if answer.code == -32005}
    passed = {name: answer.code for name, answer in answers.items() if answer.code != -32005}
    assert len(refused) == 1 and len(passed) == 1, (attempt, answers)
    (winner,) = passed
    assert passed[winner] == -32001  # past the gate, refused by the full pool
    assert refused == {next(iter(refused)): {"reason": "elsewhere", "node": winner, "address": f"{winner}.test:7443"}}
    owner = json.loads(etcd.ctl("get", f"/sandboxd/users/{user}", "--print-value-only").stdout)
    assert owner["node"] == winner, (attempt, owner)


def test_etcd_stopped_fences_both_hosts_and_they_serve_again_after(make_hosts: Any, etcd: Etcd) -> None:
    a, b = make_hosts(["a", "b"], lease_s=LEASE_S, config=NO_WARM)
    users = {a: ALICE, b: "bob@example.com"}
    for host, user in users.items():
        assert hello(host, user)["status"] == "ok"
    etcd.pause()
    stopped = time.monotonic()
    try:
        for host, user in users.items():
            wait_until(lambda: _fenced(host, user), LEASE_S + 1 - (time.monotonic() - stopped), f"{user}'s host fenced")
        fenced_after = time.monotonic() - stopped
        with a.client() as client:
            assert client.request("sandbox/status")["cluster"]["fenced"] is True
    finally:
        etcd.resume()
    resumed = time.monotonic()
    for host, user in users.items():
        wait_until(lambda: _served(host, user), 5 - (time.monotonic() - resumed), f"{user}'s host serving again")
    assert fenced_after <= LEASE_S + 1
    for host in users:
        assert host.events("cluster_fenced") and host.events("cluster_unfenced")


def _fenced(host: Daemon, user: str) -> bool:
    try:
        hello(host, user)
    except RpcError as exc:
        return exc.code == -32005 and exc.data == {"reason": "fenced"}
    return False


def _served(host: Daemon, user: str) -> bool:
    try:
        return hello(host, user)["status"] == "ok"
    except RpcError:
        return False


def test_a_killed_hosts_users_are_node_down_on_the_other(make_hosts: Any, etcd: Etcd, docker_api: Any) -> None:
    a, b = make_hosts(["a", "b"], lease_s=LEASE_S, config=NO_WARM)
    assert hello(a, ALICE)["status"] == "ok"
    assert refusal(b, ALICE)["reason"] == "elsewhere"
    assert a.proc is not None
    a.proc.send_signal(signal.SIGKILL)
    killed = time.monotonic()
    a.proc.wait(10)
    wait_until(lambda: _node_down(b, ALICE), LEASE_S + 1, "node_down on b")
    assert time.monotonic() - killed <= LEASE_S + 1
    assert not b.containers(docker_api)
    for container in a.containers(docker_api):  # what the killed daemon left: its restart would remove them
        docker_api.api.remove_container(container["Id"], force=True)


def _node_down(host: Daemon, user: str) -> bool:
    try:
        hello(host, user)
    except RpcError as exc:
        return exc.code == -32005 and exc.data == {"reason": "node_down", "node": "a"}
    return False


def test_start_up_stops_with_the_endpoints_named_when_etcd_does_not_answer(tmp_path: Any, etcd: Etcd) -> None:
    etcd.pause()  # answers nothing, like a host cut off; the daemon gives up after its bounded wait
    try:
        host = Daemon(tmp_path / "host", config=NO_WARM + cluster_section("a", etcd))
        with pytest.raises(AssertionError) as failed:
            host.start(timeout=40)
    finally:
        etcd.resume()
        shutil.rmtree(host.socket.parent, ignore_errors=True)
    assert etcd.url in str(failed.value) and "start etcd, or fix cluster.etcd" in str(failed.value)
