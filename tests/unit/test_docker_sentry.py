"""A condemned gVisor sandbox's removal: its Sentry SIGKILLed on the host first, and only a process of
that container's; a removal the engine gave up on ("did not receive an exit event") retried once the
exit came, not left for the next start. tests/e2e/test_kill.py shows the kill landing under runsc."""

from __future__ import annotations

import json
import socket
import subprocess
import threading
from pathlib import Path
from typing import Any, Iterator

import docker.errors
import pytest

from sandboxd.config import SandboxConfig
from sandboxd.sandbox.docker import backend as backend_module
from sandboxd.sandbox.docker import sentry
from sandboxd.sandbox.docker.backend import KILL_GAVE_UP, DockerBackend
from sandboxd.sandbox.docker.sentry import Outcome, Refused, kill_owned_sandbox, kill_sentry, lift_cpu_quota
from sandboxd.sandbox.docker.sockets import in_container_cgroup

CONTAINER = "c0ffee" * 10 + "abcd"


@pytest.fixture
def sleeper() -> Iterator[subprocess.Popen[bytes]]:
    process = subprocess.Popen(["sleep", "60"])
    yield process
    process.kill()
    process.wait()


def test_a_process_outside_the_containers_cgroup_is_not_signalled(sleeper: subprocess.Popen[bytes]) -> None:
    assert kill_sentry(sleeper.pid, CONTAINER) is Outcome.NOT_ITS
    assert sleeper.poll() is None


def test_the_containers_own_process_is_killed(sleeper: subprocess.Popen[bytes], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sentry, "in_container_cgroup", lambda pid, cid: (pid, cid) == (sleeper.pid, CONTAINER))
    assert kill_sentry(sleeper.pid, CONTAINER) is Outcome.KILLED
    assert sleeper.wait(5) == -9


def test_a_process_that_has_exited_is_gone() -> None:
    done = subprocess.Popen(["true"])
    done.wait()
    assert kill_sentry(done.pid, CONTAINER) is Outcome.GONE


class Engine:
    """The few calls a removal makes, recorded; ``gives_up``: removals that fail as Docker's do when
    its own SIGKILL's exit did not come within 2 s."""

    def __init__(self, *, pid: int = 0, gives_up: int = 0) -> None:
        self.pid = pid
        self.gives_up = gives_up
        self.calls: list[str] = []

    def inspect_container(self, container_id: str) -> dict[str, Any]:
        self.calls.append("inspect")
        return {"State": {"Running": self.pid > 0, "Pid": self.pid}}

    def update_container(self, container_id: str, **kwargs: Any) -> None:
        self.calls.append("update")

    def wait(self, container_id: str, timeout: float) -> dict[str, Any]:
        self.calls.append("wait")
        return {"StatusCode": 137}

    def remove_container(self, container_id: str, **kwargs: Any) -> None:
        self.calls.append("remove")
        if self.gives_up:
            self.gives_up -= 1
            raise docker.errors.APIError("500 Server Error", explanation=(
                f"Could not kill running container {container_id}, cannot remove - tried to kill container, "
                f"but {KILL_GAVE_UP}"))


def backend_on(engine: Engine, *, gvisor: bool) -> DockerBackend:
    backend = DockerBackend(SandboxConfig(), instance="test", max_line_bytes=1 << 20)
    backend._api = engine  # type: ignore[assignment]
    backend._gvisor = gvisor
    return backend


def test_under_gvisor_the_sentry_is_killed_and_its_exit_awaited_before_the_removal(
        sleeper: subprocess.Popen[bytes], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sentry, "in_container_cgroup", lambda pid, cid: pid == sleeper.pid)
    engine = Engine(pid=sleeper.pid)
    backend_on(engine, gvisor=True)._remove(CONTAINER)
    assert sleeper.wait(5) == -9
    assert engine.calls == ["inspect", "wait", "remove"]


def test_under_gvisor_a_sentry_it_may_not_signal_is_left_to_the_engine_and_said_once(
        sleeper: subprocess.Popen[bytes], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sentry, "in_container_cgroup", lambda pid, cid: True)

    def refuse(pidfd: int, sig: int) -> None:
        raise PermissionError(1, "Operation not permitted")

    monkeypatch.setattr(sentry.signal, "pidfd_send_signal", refuse)
    warnings: list[dict[str, Any]] = []
    monkeypatch.setattr(backend_module.log, "warning", lambda event, **fields: warnings.append({"event": event, **fields}))
    engine = Engine(pid=sleeper.pid)
    backend = backend_on(engine, gvisor=True)
    backend._remove(CONTAINER)
    backend._remove(CONTAINER)
    assert sleeper.poll() is None
    assert engine.calls == ["inspect", "remove", "inspect", "remove"]
    assert [w["event"] for w in warnings] == ["sandbox_killed_through_gvisor"]
    assert "sandboxd-quota.socket" in warnings[0]["fix"]


def test_under_gvisor_a_pid_outside_the_container_is_not_signalled_nor_warned_about(
        sleeper: subprocess.Popen[bytes], monkeypatch: pytest.MonkeyPatch) -> None:
    # The engine's State.Pid of a Sentry that died as it was condemned, reused by another process.
    warnings: list[str] = []
    monkeypatch.setattr(backend_module.log, "warning", lambda event, **fields: warnings.append(event))
    engine = Engine(pid=sleeper.pid)
    backend_on(engine, gvisor=True)._remove(CONTAINER)
    assert sleeper.poll() is None and not warnings
    assert engine.calls == ["inspect", "wait", "remove"]  # its Sentry is dead: the exit first (next test)


def test_under_gvisor_a_sentry_that_died_by_itself_has_its_exit_seen_before_the_removal() -> None:
    # The removal's kill must not reach the shim while it reaps the stubs: it stalled the engine 66-300 s (backend.py).
    done = subprocess.Popen(["true"])
    done.wait()  # the engine still says running, with the pid of a Sentry that has exited
    engine = Engine(pid=done.pid)
    backend_on(engine, gvisor=True)._remove(CONTAINER)
    assert engine.calls == ["inspect", "wait", "remove"]


@pytest.mark.parametrize("gvisor", [False, True])
def test_a_removal_the_engine_gave_up_on_is_retried_once_the_exit_came(gvisor: bool) -> None:
    engine = Engine(gives_up=1)
    backend_on(engine, gvisor=gvisor)._remove(CONTAINER)
    first = "inspect" if gvisor else "update"
    assert engine.calls == [first, "remove", "wait", "remove"]


def test_another_refusal_of_the_removal_is_raised_as_before() -> None:
    class Refusing(Engine):
        def remove_container(self, container_id: str, **kwargs: Any) -> None:
            raise docker.errors.APIError("500 Server Error", explanation="driver failed removing the root filesystem")

    with pytest.raises(docker.errors.APIError):
        backend_on(Refusing(), gvisor=True)._remove(CONTAINER)


@pytest.mark.parametrize(("place", "quota", "lifted"), [
    ("cpu/docker/{id}/cpu.cfs_quota_us", "25000\n", "-1"),  # cgroup v1, the cgroupfs driver
    ("cpu,cpuacct/system.slice/docker-{id}.scope/cpu.cfs_quota_us", "25000\n", "-1"),  # v1, systemd
    ("system.slice/docker-{id}.scope/cpu.max", "25000 100000\n", "max"),  # v2, systemd
])
def test_the_quota_is_lifted_where_the_engine_put_the_containers_cgroup(tmp_path: Path, place: str, quota: str,
                                                                       lifted: str) -> None:
    path = tmp_path / place.format(id=CONTAINER)
    path.parent.mkdir(parents=True)
    path.write_text(quota)
    assert lift_cpu_quota(CONTAINER, root=tmp_path)
    assert path.read_text() == lifted


def test_no_cgroup_found_lifts_nothing_and_makes_no_file(tmp_path: Path) -> None:
    (tmp_path / "cpu" / "docker" / CONTAINER).mkdir(parents=True)
    assert not lift_cpu_quota(CONTAINER, root=tmp_path)
    assert not any(p.is_file() for p in tmp_path.rglob("*"))


def test_a_process_proc_hides_is_found_in_the_containers_member_list(tmp_path: Path) -> None:
    # The unit's ProtectProc=invisible hides runsc's processes (root's, nobody's) from the unprivileged daemon.
    hidden = 2 ** 22 + 1  # no /proc entry, as for a hidden process
    members = tmp_path / "pids" / "docker" / CONTAINER / "cgroup.procs"
    members.parent.mkdir(parents=True)
    members.write_text(f"17\n{hidden}\n")
    assert in_container_cgroup(hidden, CONTAINER, root=tmp_path)
    assert not in_container_cgroup(hidden + 1, CONTAINER, root=tmp_path)
    assert not in_container_cgroup(hidden, "f" * 64, root=tmp_path)


class Inspected:
    """An engine that answers one inspect, as the helper's kill asks it."""

    def __init__(self, found: dict[str, Any] | None) -> None:
        self.found = found
        self.asked: list[str] = []

    def inspect_container(self, container_id: str) -> dict[str, Any]:
        self.asked.append(container_id)
        if self.found is None:
            raise docker.errors.NotFound("no such container")
        return self.found


def owned(pid: int, data_path: str = "/var/lib/sandboxd", **labels: str) -> dict[str, Any]:
    return {"Id": CONTAINER, "State": {"Running": True, "Pid": pid},
            "Config": {"Labels": {"org.sandboxd.managed": "1", "org.sandboxd.data-path": data_path, **labels}}}


@pytest.mark.parametrize("container", ["c0ffee", CONTAINER.upper(), CONTAINER + "0", f"../{CONTAINER[3:]}", 7, None])
def test_the_helper_kills_only_a_container_named_in_full(container: Any) -> None:
    engine = Inspected(owned(1))
    with pytest.raises(Refused, match="not a container id in full"):
        kill_owned_sandbox(engine, container, Path("/var/lib/sandboxd"))
    assert engine.asked == []  # refused before the engine is asked


@pytest.mark.parametrize("found", [
    {**owned(0), "Config": {"Labels": {}}},  # not sandboxd's
    owned(0, data_path="/srv/other"),  # another daemon's
    {**owned(0), "Id": "d" * 64},  # the engine answered for another container
])
def test_the_helper_refuses_a_container_not_of_its_daemon(found: dict[str, Any], sleeper: subprocess.Popen[bytes],
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sentry, "in_container_cgroup", lambda pid, cid: True)
    found["State"]["Pid"] = sleeper.pid
    with pytest.raises(Refused, match="is not a sandbox of the sandboxd on /var/lib/sandboxd"):
        kill_owned_sandbox(Inspected(found), CONTAINER, Path("/var/lib/sandboxd"))
    assert sleeper.poll() is None


def test_the_helper_kills_its_daemons_sentry_and_nothing_outside_the_container(
        sleeper: subprocess.Popen[bytes], monkeypatch: pytest.MonkeyPatch) -> None:
    data = Path("/var/lib/sandboxd")
    assert kill_owned_sandbox(Inspected(owned(sleeper.pid)), CONTAINER, data) is Outcome.NOT_ITS
    assert sleeper.poll() is None  # the engine's pid is not in the container's cgroup: never signalled
    assert kill_owned_sandbox(Inspected(None), CONTAINER, data) is Outcome.GONE
    monkeypatch.setattr(sentry, "in_container_cgroup", lambda pid, cid: (pid, cid) == (sleeper.pid, CONTAINER))
    assert kill_owned_sandbox(Inspected(owned(sleeper.pid)), CONTAINER, data) is Outcome.KILLED
    assert sleeper.wait(5) == -9


def fake_helper(path: Path, answer: dict[str, Any]) -> list[dict[str, Any]]:
    """A helper socket that answers every request with ``answer``; the requests it got."""
    got: list[dict[str, Any]] = []
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(str(path))
    listener.listen(4)

    def serve() -> None:
        with listener:
            conn, _ = listener.accept()
            with conn:
                got.append(json.loads(conn.makefile("rb").readline()))
                conn.sendall(json.dumps(answer).encode() + b"\n")

    threading.Thread(target=serve, daemon=True).start()
    return got


def test_a_daemon_that_may_not_signal_the_sentry_asks_the_privileged_helper(
        tmp_path: Path, sleeper: subprocess.Popen[bytes], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sentry, "in_container_cgroup", lambda pid, cid: True)
    monkeypatch.setattr(sentry.signal, "pidfd_send_signal", lambda pidfd, sig: (_ for _ in ()).throw(PermissionError(1, "")))
    got = fake_helper(tmp_path / "helper.sock", {"ok": True, "outcome": "killed"})
    engine = Engine(pid=sleeper.pid)
    backend = DockerBackend(SandboxConfig(), instance="test", max_line_bytes=1 << 20, helper=tmp_path / "helper.sock")
    backend._api = engine  # type: ignore[assignment]
    backend._gvisor = True
    backend._remove(CONTAINER)
    assert got == [{"op": "kill", "container": CONTAINER}]
    assert engine.calls == ["inspect", "wait", "remove"]  # killed: its exit awaited, as when the daemon kills


def test_a_helper_that_refuses_leaves_the_kill_to_the_engine_and_says_why(
        tmp_path: Path, sleeper: subprocess.Popen[bytes], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sentry, "in_container_cgroup", lambda pid, cid: True)
    monkeypatch.setattr(sentry.signal, "pidfd_send_signal", lambda pidfd, sig: (_ for _ in ()).throw(PermissionError(1, "")))
    fake_helper(tmp_path / "helper.sock", {"error": "container c0ffeec0ffee is not a sandbox of the sandboxd on /x"})
    warnings: list[dict[str, Any]] = []
    monkeypatch.setattr(backend_module.log, "warning", lambda event, **fields: warnings.append({"event": event, **fields}))
    engine = Engine(pid=sleeper.pid)
    backend = DockerBackend(SandboxConfig(), instance="test", max_line_bytes=1 << 20, helper=tmp_path / "helper.sock")
    backend._api = engine  # type: ignore[assignment]
    backend._gvisor = True
    backend._remove(CONTAINER)
    assert engine.calls == ["inspect", "remove"]
    assert "is not a sandbox of" in warnings[0]["helper"]
