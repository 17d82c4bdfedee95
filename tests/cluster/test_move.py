"""`sandboxd users move` and `sandboxd nodes drain` end to end (issue 46, item 5; issue 47, item 3).

Real etcd, real daemons with mutual-TLS listeners on 127.0.0.1 and certificates made with openssl,
the operator's commands as a subprocess with an operator:ops certificate. The move's hosts each have
a btrfs loop filesystem of their own under a hard quota; a client calls the user in a loop through
the daemons directly, following ``elsewhere``, while the user moves. The drain's three hosts use
plain data paths (an export that holds the user's calls instead of a snapshot).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import sqlite3
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, Iterator

import pytest

from sandboxd.client import Client
from sandboxd.wire import RpcError
from tests.cluster.certs import ClusterCerts, make_certs
from tests.cluster.etcd import Etcd, free_port
from tests.e2e.conftest import Daemon, write_tool
from tests.e2e.hostile_harness import wait_until
from tests.e2e.test_users_transfer import FILL, FILL_INPUTS, HARD, QUOTA_MIB, open_writer, qgroup_limit, tree
from tests.e2e.test_users_transfer import cli as transfer_cli
from tests.loopfs import MIB, loop_devices_usable, loop_filesystem

pytestmark = pytest.mark.docker

USER = "mover@example.com"
KEEP_MOVED_S = 8


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> ClusterCerts:
    return make_certs(tmp_path_factory.mktemp("certs"))


class Cluster:
    """Hosts with listeners and their own certificates, and the operator's configuration."""

    def __init__(self, root: Path, etcd: Etcd, certs: ClusterCerts) -> None:
        self.root, self.etcd, self.certs = root, etcd, certs
        self.hosts: dict[str, Daemon] = {}
        self.operator = root / "operator.yaml"
        self.operator.write_text(f"cluster:\n  etcd: ['{etcd.url}']\n" + certs.operator.tls_yaml())

    def host(self, name: str, config: str, *, start: bool = True) -> Daemon:
        cert = self.certs.ca.issue(f"node:{name}") if name not in "ab" else getattr(self.certs, f"node_{name}")
        port = free_port()
        daemon = Daemon(self.root / f"host-{name}", config=config + (
            f"cluster:\n  node: {name}\n  etcd: ['{self.etcd.url}']\n  lease_s: 3\n  listen: 127.0.0.1:{port}\n"
            f"  keep_moved_s: {KEEP_MOVED_S}\n" + cert.tls_yaml()))
        self.hosts[name] = daemon
        return daemon.start() if start else daemon

    def stop(self) -> None:
        for host in self.hosts.values():
            if host.proc is not None and host.proc.poll() is None:
                host.stop()

    def cli(self, *args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "sandboxd", *args, "--config", str(self.operator)],
                              capture_output=True, text=True, timeout=300, check=False,
                              env={k: v for k, v in os.environ.items() if not k.startswith("SANDBOXD_")})

    def where(self, user: str) -> dict[str, Any]:
        answer = self.cli("users", "where", user, "--json")
        assert answer.returncode == 0, answer.stderr
        return dict(json.loads(answer.stdout))


@pytest.fixture
def cluster(tmp_path: Path, etcd: Etcd, certs: ClusterCerts, docker_api: Any) -> Iterator[Cluster]:
    made = Cluster(tmp_path, etcd, certs)
    try:
        yield made
    finally:
        made.stop()
        for host in made.hosts.values():
            host.remove_leftovers(docker_api)


@contextlib.contextmanager
def stopped(cluster: Cluster) -> Iterator[None]:
    """The hosts stopped at the end of the block: before their loop filesystems are taken down."""
    try:
        yield
    finally:
        cluster.stop()


class Caller(threading.Thread):
    """Calls ``user`` in a loop through the hosts directly: a refusal's ``elsewhere`` names the host to try next,
    ``moving`` is waited out. Every answer is kept: (outcome, host); anything else (a timeout) is a failure."""

    def __init__(self, hosts: dict[str, Daemon], user: str, first: str) -> None:
        super().__init__(daemon=True)
        self.hosts, self.user, self.at = hosts, user, first
        self.answers: list[tuple[str, str]] = []
        self.failures: list[str] = []
        self.halt = threading.Event()

    def run(self) -> None:
        while not self.halt.is_set():
            try:
                with Client(self.hosts[self.at].socket, timeout=30) as client:
                    client.call_tool(self.user, "hello", {"name": "x"}, timeoutMs=20_000)
                self.answers.append(("ok", self.at))
            except RpcError as exc:
                reason = (exc.data or {}).get("reason") if isinstance(exc.data, dict) else None
                if reason not in ("moving", "elsewhere"):
                    self.failures.append(f"{self.at}: {exc.code} {exc.message}")
                    continue
                self.answers.append((reason, self.at))
                if reason == "elsewhere":
                    self.at = exc.data["node"]
                else:
                    time.sleep(0.05)
            except Exception as exc:  # noqa: BLE001 - a timeout or a lost connection: what must not happen
                self.failures.append(f"{self.at}: {type(exc).__name__}: {exc}")

    def stop(self) -> None:
        self.halt.set()
        self.join(60)


def spans(host: Daemon, user: str) -> list[tuple[int, float, float]]:
    return [(e["epoch"], e["start"], e["end"]) for e in host.events("call_served", user=user)]


def no_overlap(a: Daemon, b: Daemon, user: str) -> None:
    """Every call of ``user`` on ``a`` ended before the first on ``b`` began, at a lower epoch (the per-host logs)."""
    on_a, on_b = spans(a, user), spans(b, user)
    assert on_a and on_b, (on_a, on_b)
    assert max(end for _, _, end in on_a) <= min(start for _, start, _ in on_b), (on_a, on_b)
    assert max(epoch for epoch, _, _ in on_a) < min(epoch for epoch, _, _ in on_b), (on_a, on_b)


def hello(host: Daemon, user: str) -> None:
    with host.client() as client:
        client.call_tool(user, "hello", {"name": "x"})


@pytest.mark.skipif(bool(loop_devices_usable("btrfs")), reason=str(loop_devices_usable("btrfs")))
def test_a_user_moves_a_to_b_under_calls_with_every_byte_row_and_the_quota(cluster: Cluster) -> None:
    root = cluster.root
    with loop_filesystem(root / "host-a" / "data", "btrfs", 768), \
            loop_filesystem(root / "host-b" / "data", "btrfs", 768), stopped(cluster):
        a = cluster.host("a", HARD, start=False)
        write_tool(a.data / USER / "tools", "my_fill", FILL, inputs=FILL_INPUTS)  # the user's own tool
        a.start()
        b = cluster.host("b", HARD)
        with a.client() as client:
            assert "wrote 64 MiB" in json.dumps(client.call_tool(USER, "my_fill", {"file": "big", "mib": 64},
                                                                 timeoutMs=120_000))
        small = a.data / USER / "small"
        small.mkdir()
        for i in range(200):
            (small / f"{i:03}.txt").write_bytes(os.urandom(100 + i))
        writer = open_writer(a.data / "email" / USER / "emails.db")  # the mail sync's stand-in, left open
        assert (a.data / "email" / USER / "emails.db-wal").stat().st_size > 300 * 300, "rows not in the WAL"
        rows = writer.execute("SELECT id, subject, body FROM mail ORDER BY id").fetchall()
        before, limit = tree(a.data / USER), qgroup_limit(a.data / USER)
        assert limit == QUOTA_MIB * MIB

        caller = Caller(cluster.hosts, USER, "a")
        caller.start()
        wait_until(lambda: len(caller.answers) >= 3, 60, "the caller's first calls on a")
        moved = cluster.cli("users", "move", USER, "--to", "b", "--json")
        assert moved.returncode == 0, moved.stderr
        wait_until(lambda: ("ok", "b") in caller.answers, 60, "a call served on b after the move")
        caller.stop()
        assert json.loads(moved.stdout)["to"] == "b" and json.loads(moved.stdout)["files"] == 203
        assert not caller.failures, caller.failures[:5]
        assert {outcome for outcome, _ in caller.answers} <= {"ok", "moving", "elsewhere"}
        assert ("ok", "a") in caller.answers and ("moving", "a") in caller.answers  # refused meanwhile, not stalled
        assert cluster.where(USER)["node"] == "b"

        # A set its copy aside, read-only and unserved (and removes it keep_moved_s later, below).
        assert not (a.data / USER).exists()
        aside = list(a.data.glob(f"{USER}~sandboxd-moved-*"))
        assert len(aside) == 1 and hashlib.sha256((aside[0] / "big").read_bytes()).hexdigest() == before["big"][0]
        with pytest.raises(OSError):
            (aside[0] / "new").write_bytes(b"x")

        # The tools folder's ACL mask (its group bits) is what provisioning gave it on b's first call.
        assert _without_tools_mode(tree(b.data / USER)) == _without_tools_mode(before)
        copy = sqlite3.connect(b.data / "email" / USER / "emails.db")
        assert copy.execute("SELECT id, subject, body FROM mail ORDER BY id").fetchall() == rows
        copy.close()
        writer.close()
        assert qgroup_limit(b.data / USER) == limit  # B's kernel holds the user at the same limit

        time.sleep(1.5)  # call_served lines are written each second
        no_overlap(a, b, USER)
        wait_until(lambda: not list(a.data.glob("*~sandboxd-moved-*")), KEEP_MOVED_S + 10,
                   "the moved copy removed after keep_moved_s")
        assert not list(b.data.glob("*~sandboxd-*")) and not list(a.data.glob("*~sandboxd-export*"))


def _without_tools_mode(found: dict[str, tuple[str, int]]) -> dict[str, tuple[str, int]]:
    return {path: (what, 0 if path == "tools" else mode) for path, (what, mode) in found.items()}


@pytest.mark.skipif(bool(loop_devices_usable("btrfs")), reason=str(loop_devices_usable("btrfs")))
def test_a_move_that_fails_leaves_the_user_served_on_a(cluster: Cluster) -> None:
    root = cluster.root
    with loop_filesystem(root / "host-a" / "data", "btrfs", 512), \
            loop_filesystem(root / "host-b" / "data", "btrfs", 512), stopped(cluster):
        a, b = cluster.host("a", HARD), cluster.host("b", HARD)
        hello(a, USER)
        writer = open_writer(a.data / "email" / USER / "emails.db")
        (a.data / USER / "big").write_bytes(os.urandom(96 * MIB))  # streaming it gives the writer its moment
        epoch = cluster.where(USER)["epoch"]

        # 1. The email database changes after the snapshot: refused before the flip, B's import removed.
        mover = subprocess.Popen([sys.executable, "-m", "sandboxd", "users", "move", USER, "--to", "b", "--json",
                                  "--config", str(cluster.operator)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                 text=True)
        wait_until(lambda: a.events("move_snapshot", user=USER), 60, "a's snapshot of the move")
        writer.execute("INSERT INTO mail (subject) VALUES ('after the snapshot')")
        out, err = mover.communicate(timeout=120)
        assert mover.returncode == 1, (out, err)
        answer = json.loads(out)
        assert answer["step"] == "check" and "stop the mail sync" in answer["error"].lower(), answer
        assert "active on a again" in answer["error"]
        _served_on_a(cluster, a, USER, epoch)
        assert not (b.data / USER).exists() and not (b.data / "email" / USER).exists()

        # 2. A call in flight outlives --wait: the move gives up at pull, and the call ends on a, answered.
        answered: list[Any] = []
        holder = threading.Thread(target=lambda: answered.append(_sleep(a, USER, 6000)))
        holder.start()
        wait_until(lambda: _in_flight(a) == 1, 30, "the sleeper's call in flight on a")
        slow = cluster.cli("users", "move", USER, "--to", "b", "--wait", "1")
        assert slow.returncode == 1 and "step pull" in slow.stderr and "still ran after 1 s" in slow.stderr, slow.stderr
        holder.join(60)
        assert answered == ["ok"]
        _served_on_a(cluster, a, USER, epoch)

        # 3. The target refuses: the user already has data there (kept: a refused import removes nothing of it).
        writer.close()
        (b.data / USER).mkdir()
        (b.data / USER / "stale").write_text("left by hand")
        refused = cluster.cli("users", "move", USER, "--to", "b")
        assert refused.returncode == 1, refused.stderr
        assert "step pull" in refused.stderr and "already has data on this host" in refused.stderr, refused.stderr
        _served_on_a(cluster, a, USER, epoch)
        assert (b.data / USER / "stale").read_text() == "left by hand"
        assert (a.data / USER / "big").stat().st_size == 96 * MIB


def _sleep(host: Daemon, user: str, ms: int) -> str:
    with host.client() as client:
        return str(client.call_tool(user, "sleeper", {"ms": ms})["status"])


def _in_flight(host: Daemon) -> int:
    with host.client() as client:
        return int(client.request("sandbox/status")["callsInFlight"])


def _served_on_a(cluster: Cluster, a: Daemon, user: str, epoch: int) -> None:
    where = cluster.where(user)
    assert (where["node"], where["state"]) == ("a", "active") and where["epoch"] > epoch, where
    wait_until(lambda: _answers(a, user), 10, "a serves the user again")


def _answers(host: Daemon, user: str) -> bool:
    try:
        hello(host, user)
    except RpcError:
        return False
    return True


DRAIN_USERS = ["d1@example.com", "d2@example.com", "d3@example.com"]


def test_a_drained_host_moves_its_users_to_the_others_and_takes_no_new_one(cluster: Cluster) -> None:
    config = "pool:\n  min_idle: 0\n"
    hosts = {name: cluster.host(name, config) for name in ("a", "b", "c")}
    a = hosts["a"]
    for user in DRAIN_USERS:
        hello(a, user)
        (a.data / user / "note.txt").write_text(f"{user}'s note")
    callers = [Caller(cluster.hosts, user, "a") for user in DRAIN_USERS]
    for caller in callers:
        caller.start()

    drained = cluster.cli("nodes", "drain", "a", "--json")
    for caller in callers:
        wait_until(lambda: caller.answers[-1:] and caller.answers[-1][1] != "a", 60, f"{caller.user} served elsewhere")
        caller.stop()
    assert drained.returncode == 0, drained.stderr
    lines = [json.loads(line) for line in drained.stdout.splitlines()]
    assert sorted(line["user"] for line in lines) == DRAIN_USERS and all(line["ok"] for line in lines), lines
    for caller in callers:
        assert not caller.failures, caller.failures[:5]
        assert {outcome for outcome, _ in caller.answers} <= {"ok", "moving", "elsewhere"}
    for line in lines:
        home = cluster.where(line["user"])["node"]
        assert home == line["to"] in ("b", "c")
        assert (hosts[home].data / line["user"] / "note.txt").read_text() == f"{line['user']}'s note"
    listed = {n["node"]: n for n in json.loads(cluster.cli("nodes", "list", "--json").stdout)["nodes"]}
    assert (listed["a"]["state"], listed["a"]["users"]) == ("draining", 0)

    # A new user asked on the draining host is sent where rendezvous places them; undrained, a claims one again.
    with pytest.raises(RpcError) as refused:
        hello(a, "newcomer@example.com")
    assert refused.value.data["reason"] == "elsewhere" and refused.value.data["node"] in ("b", "c")
    assert cluster.cli("nodes", "undrain", "a").returncode == 0
    wait_until(lambda: _answers(a, "newcomer2@example.com"), 10, "a claims a new user once undrained")


REHOMED = "rehomed@example.com"


def test_a_dead_hosts_user_is_rehomed_with_a_backup_and_the_host_back_sets_its_copy_aside(
        cluster: Cluster, tmp_path: Path) -> None:
    config = "pool:\n  min_idle: 0\n"
    a, b = cluster.host("a", config), cluster.host("b", config)
    hello(a, REHOMED)
    (a.data / REHOMED / "note.txt").write_text("written on a")
    backup = tmp_path / "backup.tar.zst"
    exported = transfer_cli("users", "export", REHOMED, "--out", str(backup), "--socket", str(a.socket))
    assert exported.returncode == 0, exported.stderr

    up = cluster.cli("users", "rehome", REHOMED, "--to", "b")  # a holds its lease: it may serve them
    assert up.returncode == 1 and "is up" in up.stderr and "users move" in up.stderr, up.stderr
    assert cluster.where(REHOMED)["node"] == "a"

    assert a.proc is not None
    a.proc.send_signal(signal.SIGKILL)
    a.proc.wait()
    wait_until(lambda: not cluster.where(REHOMED)["up"], 10, "a's lease to expire")
    restored = transfer_cli("users", "import", str(backup), "--socket", str(b.socket))
    assert restored.returncode == 0, restored.stderr
    with pytest.raises(RpcError) as down:
        hello(b, REHOMED)
    assert down.value.data == {"reason": "node_down", "node": "a"}  # restored, not yet theirs

    rehomed = cluster.cli("users", "rehome", REHOMED, "--to", "b", "--json")
    assert rehomed.returncode == 0, rehomed.stderr
    answer = json.loads(rehomed.stdout)
    assert (answer["from"], answer["to"]) == ("a", "b") and answer["epoch"] == cluster.where(REHOMED)["epoch"]
    wait_until(lambda: _answers(b, REHOMED), 10, "b serving the rehomed user")
    assert (b.data / REHOMED / "note.txt").read_text() == "written on a"

    # a back: it refuses them elsewhere, and its stale copy goes aside (not served, removed after keep_moved_s).
    a.start()
    with pytest.raises(RpcError) as elsewhere:
        hello(a, REHOMED)
    assert elsewhere.value.data["reason"] == "elsewhere" and elsewhere.value.data["node"] == "b"
    wait_until(lambda: not (a.data / REHOMED).exists(), 10, "a's stale copy set aside")
    assert [path.name.split("~")[0] for path in a.data.iterdir() if "~sandboxd-moved-" in path.name] == [REHOMED]

