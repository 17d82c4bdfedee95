"""Dangerous settings need a named override; socket directories nobody else can write; the sandboxes' network."""

from __future__ import annotations

import os
import pwd
import socket
import stat
from pathlib import Path
from typing import Any

import docker.errors
import pytest

from sandboxd.cli.main import main
from sandboxd.config import BRIDGE_NETWORK, DEFAULT_NETWORK, UNSAFE_NAMES, Config, SandboxConfig, check_unsandboxed, load_config
from sandboxd.errors import BackendUnavailable, ConfigError
from sandboxd.sandbox.docker.backend import ICC_OPTION, DockerBackend
from sandboxd.sandbox.docker.spec import LABEL_MANAGED
from sandboxd.unixsocket import bind_unix_socket, secure_directory

NO_ACCOUNT_UID = next(uid for uid in range(2_000_000_001, 2_000_001_000) if uid not in {p.pw_uid for p in pwd.getpwall()})
HOST_ACCOUNT = next(p for p in pwd.getpwall() if p.pw_uid not in (0, os.geteuid()))

DANGEROUS = [
    # (environment, override, words the refusal must contain)
    ({"SANDBOXD_SANDBOX_NETWORK": "host"}, "host_network", "sandbox.network 'host' gives tools the network of the host"),
    ({"SANDBOXD_SANDBOX_NETWORK": "container:db"}, "host_network", "sandbox.network 'container:db'"),
    ({"SANDBOXD_SANDBOX_NETWORK": "bridge"}, "shared_network", "sandboxes of different users"),
    ({"SANDBOXD_SANDBOX_CAP_ADD": "[NET_RAW]"}, "cap_add", "sandbox.cap_add [NET_RAW] gives tools back capabilities"),
    ({"SANDBOXD_SANDBOX_READ_ONLY_ROOT": "false"}, "writable_root", "sandbox.read_only_root false"),
    ({"SANDBOXD_SANDBOX_USER": f"'{HOST_ACCOUNT.pw_uid}:{HOST_ACCOUNT.pw_gid or 1}'"}, "host_uid",
     f"the host account {HOST_ACCOUNT.pw_name!r}"),
]


@pytest.mark.parametrize(("environ", "name", "words"), DANGEROUS)
def test_a_dangerous_setting_names_its_risk_and_its_override(environ: dict[str, str], name: str, words: str) -> None:
    with pytest.raises(ConfigError) as info:
        load_config(environ=environ)
    assert words in info.value.message
    assert f"set allow_unsafe: [{name}] to accept it" in info.value.message
    accepted = load_config(environ={**environ, "SANDBOXD_ALLOW_UNSAFE": f'["{name}"]'})
    assert accepted.allow_unsafe == [name]


def test_another_override_does_not_accept_it() -> None:
    with pytest.raises(ConfigError, match=r"allow_unsafe: \[cap_add\]"):
        load_config(environ={"SANDBOXD_SANDBOX_CAP_ADD": "[NET_RAW]", "SANDBOXD_ALLOW_UNSAFE": "[writable_root]"})


def test_every_missing_override_is_named_at_once(tmp_path: Path) -> None:
    path = tmp_path / "config.yaml"
    path.write_text("sandbox:\n  network: host\n  cap_add: [SYS_ADMIN]\n  read_only_root: false\n")
    with pytest.raises(ConfigError) as info:
        load_config(path, environ={})
    for name in ("host_network", "cap_add", "writable_root"):
        assert f"allow_unsafe: [{name}]" in info.value.message
    path.write_text(path.read_text() + "allow_unsafe: [host_network, cap_add, writable_root]\n")
    assert load_config(path, environ={}).sandbox.network == "host"


def test_the_defaults_and_safe_settings_need_no_override() -> None:
    assert Config().allow_unsafe == [] and Config().sandbox.network == DEFAULT_NETWORK
    for environ in ({"SANDBOXD_SANDBOX_NETWORK": "none"}, {"SANDBOXD_SANDBOX_USER": f"'{NO_ACCOUNT_UID}:{NO_ACCOUNT_UID}'"},
                    {"SANDBOXD_BACKEND": "process"}, {"SANDBOXD_BACKEND": "fake"}):
        load_config(environ=environ)  # process: `sandboxd run --backend process` is itself the explicit choice


@pytest.mark.parametrize("user", ["0:0", "0:1000", "2000000000:0"])
def test_root_in_the_sandbox_is_refused_even_with_every_override(user: str) -> None:
    with pytest.raises(ConfigError, match="runs tools as root .* never allowed; use auto"):
        load_config(environ={"SANDBOXD_SANDBOX_USER": f"'{user}'", "SANDBOXD_ALLOW_UNSAFE": str(list(UNSAFE_NAMES))})


def test_an_unquoted_uid_gid_says_to_quote_it(tmp_path: Path) -> None:
    path = tmp_path / "config.yaml"
    path.write_text("sandbox:\n  user: 2000000001:50\n")  # base 60 when each part after a colon is below 60
    with pytest.raises(ConfigError, match="sandbox.user: an unquoted uid:gid is read by YAML as a number; quote it"):
        load_config(path, environ={})


def test_the_daemons_own_uid_needs_host_uid(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(os, "geteuid", lambda: NO_ACCOUNT_UID)  # a daemon uid with no passwd entry
    with pytest.raises(ConfigError, match=r"the daemon's own uid.*allow_unsafe: \[host_uid\]"):
        load_config(environ={"SANDBOXD_SANDBOX_USER": f"'{NO_ACCOUNT_UID}:{NO_ACCOUNT_UID}'"})


def test_unknown_override_names_are_errors_and_a_bare_name_is_a_list_of_one() -> None:
    with pytest.raises(ConfigError, match="'root_please' is not an override name; the names are host_network, "):
        load_config(environ={"SANDBOXD_ALLOW_UNSAFE": "[root_please]"})
    assert load_config(environ={"SANDBOXD_ALLOW_UNSAFE": "cap_add"}).allow_unsafe == ["cap_add"]


def test_serve_on_the_process_backend_needs_unsandboxed(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    process = load_config(environ={"SANDBOXD_BACKEND": "process"})
    with pytest.raises(ConfigError, match=r"backend 'process' runs tools .*allow_unsafe: \[unsandboxed\]"):
        check_unsandboxed(process)
    check_unsandboxed(load_config(environ={"SANDBOXD_BACKEND": "process", "SANDBOXD_ALLOW_UNSAFE": "[unsandboxed]"}))
    check_unsandboxed(load_config(environ={"SANDBOXD_BACKEND": "fake"}))  # the tests' backend runs no tool code
    sock = tmp_path / "s.sock"
    code = main(["serve", "--backend", "process", "--socket", str(sock), "--data-path", str(tmp_path / "data")])
    assert code == 2 and "set allow_unsafe: [unsandboxed] to accept it" in capsys.readouterr().err
    assert not sock.exists()  # refused before anything was bound


# --- socket directories --------------------------------------------------------------------------

def owned_by_someone_else(path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """As root: give ``path`` away. Otherwise: pretend the daemon runs as another uid."""
    if os.geteuid() == 0:
        os.chown(path, NO_ACCOUNT_UID, NO_ACCOUNT_UID)
    else:
        real = os.geteuid()
        monkeypatch.setattr(os, "geteuid", lambda: real + 1)


def test_a_missing_directory_is_made_with_exactly_its_mode(tmp_path: Path) -> None:
    old = os.umask(0o002)  # a loose umask must not leave anything group-writable
    try:
        secure_directory(tmp_path / "a" / "b", mode=0o700, what="the test directory")
    finally:
        os.umask(old)
    assert stat.S_IMODE((tmp_path / "a").stat().st_mode) == 0o755
    assert stat.S_IMODE((tmp_path / "a" / "b").stat().st_mode) == 0o700


def test_a_directory_of_another_user_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    squatted = tmp_path / "sandboxd-1000"
    squatted.mkdir(mode=0o755)
    owned_by_someone_else(squatted, monkeypatch)
    with pytest.raises(OSError, match=r"the socket's directory .*sandboxd-1000 belongs to uid \d+, not to sandboxd's "
                                      r"user .* its owner can replace the socket; remove it"):
        bind_unix_socket(squatted / "sandboxd.sock", mode=0o660, group=None, backlog=1, in_use_hint="")
    assert not (squatted / "sandboxd.sock").exists()


def test_a_directory_others_can_write_is_refused(tmp_path: Path) -> None:
    loose = tmp_path / "run"
    loose.mkdir()
    os.chmod(loose, 0o777)
    with pytest.raises(OSError, match=r"writable by its group or by others \(mode 0777\).*chmod go-w"):
        bind_unix_socket(loose / "sandboxd.sock", mode=0o660, group=None, backlog=1, in_use_hint="")


def test_a_link_in_place_of_the_directory_is_refused(tmp_path: Path) -> None:
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "run").symlink_to(tmp_path / "elsewhere")
    with pytest.raises(OSError, match="is not a directory but a link or a file"):
        bind_unix_socket(tmp_path / "run" / "sandboxd.sock", mode=0o660, group=None, backlog=1, in_use_hint="")


def test_a_safe_directory_binds(tmp_path: Path) -> None:
    sock = bind_unix_socket(tmp_path / "run" / "s.sock", mode=0o660, group=None, backlog=1, in_use_hint="")
    try:
        assert stat.S_ISSOCK((tmp_path / "run" / "s.sock").stat().st_mode)
    finally:
        sock.close()


def backend_with_shims(shims: Path) -> DockerBackend:
    return DockerBackend(SandboxConfig(), instance="test", max_line_bytes=1 << 20, shim_dir=shims)


def test_the_shims_directory_is_checked_at_start(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    run = tmp_path / "run"
    backend_with_shims(run / "s.sock.shims")  # made: 0755 and 0700
    assert stat.S_IMODE((run / "s.sock.shims").stat().st_mode) == 0o700
    os.chmod(run / "s.sock.shims", 0o733)
    with pytest.raises(OSError, match=r"the shim sockets' directory .* writable by its group or by others \(mode 0733\)"):
        backend_with_shims(run / "s.sock.shims")
    os.chmod(run / "s.sock.shims", 0o700)
    owned_by_someone_else(run / "s.sock.shims", monkeypatch)
    with pytest.raises(OSError, match="the shim sockets' directory .* belongs to uid"):
        backend_with_shims(run / "s.sock.shims")


def test_the_shims_directory_beside_a_squatted_socket_directory_is_refused(tmp_path: Path) -> None:
    os.chmod(tmp_path, 0o777)
    try:
        with pytest.raises(OSError, match="the socket's directory .* writable by its group or by others"):
            backend_with_shims(tmp_path / "s.sock.shims")
        assert not (tmp_path / "s.sock.shims").exists()  # nothing made inside it
    finally:
        os.chmod(tmp_path, 0o700)


def test_an_unsafe_temporary_shims_directory_fails_the_start(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    backend = DockerBackend(SandboxConfig(), instance="test", max_line_bytes=1 << 20)
    backend._shim_dir = tmp_path / "shims"
    (tmp_path / "shims").mkdir(mode=0o700)
    owned_by_someone_else(tmp_path / "shims", monkeypatch)
    with pytest.raises(BackendUnavailable, match="belongs to uid"):
        backend.shim_dir()


# --- the sandboxes' network ----------------------------------------------------------------------

class FakeNetworks:
    """The two network calls of the Docker API, over a dict."""

    def __init__(self, existing: dict[str, Any] | None = None, *, race: bool = False) -> None:
        self.networks = dict(existing or {})
        self.created: list[dict[str, Any]] = []
        self.race = race  # another daemon creates it between our inspect and our create

    def inspect_network(self, name: str) -> dict[str, Any]:
        if name not in self.networks:
            raise docker.errors.NotFound("no such network")
        return self.networks[name]

    def create_network(self, name: str, **kwargs: Any) -> None:
        network = {"Name": name, "Labels": kwargs["labels"], "Options": kwargs["options"]}
        self.networks[name] = network
        if self.race:
            response = type("Response", (), {"status_code": 409, "reason": "Conflict"})()
            raise docker.errors.APIError("network with name sandboxd already exists", response=response)
        self.created.append(kwargs)


def backend_on(api: FakeNetworks, network: str = BRIDGE_NETWORK) -> DockerBackend:
    backend = DockerBackend(SandboxConfig(network=network), instance="test", max_line_bytes=1 << 20)
    backend._api = api  # type: ignore[assignment]
    return backend


def test_the_daemons_bridge_is_made_with_inter_container_traffic_off() -> None:
    api = FakeNetworks()
    assert backend_on(api)._network() == BRIDGE_NETWORK
    assert api.created == [{"driver": "bridge", "options": {ICC_OPTION: "false"}, "labels": {LABEL_MANAGED: "1"},
                            "check_duplicate": True}]
    assert backend_on(api)._network() == BRIDGE_NETWORK and len(api.created) == 1  # made once, then found
    assert backend_on(FakeNetworks(race=True))._network() == BRIDGE_NETWORK  # made by another daemon meanwhile


@pytest.mark.parametrize("network", [
    {"Labels": {}, "Options": {ICC_OPTION: "false"}},  # someone else's network of that name
    {"Labels": {LABEL_MANAGED: "1"}, "Options": {}},  # ours in name, but containers on it talk
    {"Labels": {LABEL_MANAGED: "1"}, "Options": {ICC_OPTION: "true"}},
])
def test_a_network_of_that_name_that_lets_containers_talk_is_refused(network: dict[str, Any]) -> None:
    api = FakeNetworks({BRIDGE_NETWORK: network})
    with pytest.raises(BackendUnavailable, match=r"remove it \(docker network rm sandboxd\)"):
        backend_on(api)._network()


def test_other_networks_are_used_as_named() -> None:
    api = FakeNetworks()
    assert backend_on(api, "none")._network() == "none" and api.created == []


def test_a_socket_in_the_refused_directory_stays_unbound(tmp_path: Path) -> None:
    """The refusal comes before the bind: nothing listens where a client would look."""
    os.chmod(tmp_path, 0o770)
    try:
        with pytest.raises(OSError):
            bind_unix_socket(tmp_path / "s.sock", mode=0o660, group=None, backlog=1, in_use_hint="")
        probe = socket.socket(socket.AF_UNIX)
        with pytest.raises(OSError):
            probe.connect(str(tmp_path / "s.sock"))
        probe.close()
    finally:
        os.chmod(tmp_path, 0o700)


def test_allow_unsafe_changes_live_with_the_sandbox_settings_it_accepts() -> None:
    from sandboxd.config import needs_restart

    assert not needs_restart("allow_unsafe") and not needs_restart("sandbox.cap_add")


# --- the shim's socket --------------------------------------------------------------------------

def test_a_shim_socket_serves_only_a_peer_with_the_sandbox_uid(tmp_path: Path) -> None:
    import asyncio

    from sandboxd.sandbox.docker.sockets import SandboxPeer, SandboxSockets
    from sandboxd.sandbox.docker.spec import SHIM_SOCKET_NAME

    async def connect_to(listener: SandboxSockets) -> socket.socket:
        client = socket.socket(socket.AF_UNIX)
        client.connect(str(listener.dir / SHIM_SOCKET_NAME))
        try:
            return await asyncio.wait_for(listener.accept("0123456789ab" * 5), 10)
        finally:
            client.close()

    async def scenario() -> None:
        stranger = SandboxSockets(tmp_path, "test", SandboxPeer(NO_ACCOUNT_UID))  # we are not the sandbox's uid
        try:
            with pytest.raises(BackendUnavailable, match=rf"not the sandbox's shim \(pid {os.getpid()}, uid "
                                                         rf"{os.geteuid()}; the sandbox runs as {NO_ACCOUNT_UID}\)"):
                await connect_to(stranger)
        finally:
            stranger.close()
        # gVisor: a host process outside the container's cgroup is refused, whatever its uid.
        foreign = SandboxSockets(tmp_path, "test", SandboxPeer(os.geteuid(), gvisor=True))
        try:
            with pytest.raises(BackendUnavailable, match=rf"not the sandbox's shim \(pid {os.getpid()}, uid "
                                                         rf"{os.geteuid()}, is not runsc's process of the sandbox's "
                                                         r"container 0123456789ab \(gVisor\)\)"):
                await connect_to(foreign)
        finally:
            foreign.close()
        own = SandboxSockets(tmp_path, "test", SandboxPeer(os.geteuid()))
        try:
            (await connect_to(own)).close()
        finally:
            own.close()

    asyncio.run(scenario())


def test_under_gvisor_the_peer_is_known_by_its_container_s_cgroup_and_under_runc_by_its_uid() -> None:
    from sandboxd.sandbox.docker.sockets import SandboxPeer, in_container_cgroup
    from sandboxd.service.peercred import PeerCredentials

    with open("/proc/self/cgroup") as lines:
        own = [line.strip().split(":", 2)[2].rsplit("/", 1)[-1] for line in lines]
    leaf = next((name for name in own if name), None)
    if leaf is None:
        pytest.skip("this process is in no named cgroup")
    assert in_container_cgroup(os.getpid(), leaf)
    assert not in_container_cgroup(os.getpid(), "0123456789ab" * 5)
    assert not in_container_cgroup(2 ** 22 + 1, leaf)  # no such process
    root = PeerCredentials(os.getpid(), 0, 0)
    assert SandboxPeer(NO_ACCOUNT_UID, gvisor=True).problem(root, leaf) is None
    assert SandboxPeer(NO_ACCOUNT_UID, gvisor=True).problem(PeerCredentials(os.getpid(), 1000, 0), leaf) is not None
    assert SandboxPeer(NO_ACCOUNT_UID).problem(root, leaf) is not None  # runc: the uid check, as before
    assert SandboxPeer(NO_ACCOUNT_UID).problem(PeerCredentials(1, NO_ACCOUNT_UID, 0), leaf) is None


# --- why a sandbox ended ---------------------------------------------------------------------

@pytest.mark.parametrize(("state", "words"), [
    ({"OOMKilled": True, "ExitCode": 137}, "ran out of memory: its sandbox is limited to 96m"),
    ({"ExitCode": 137}, "was killed (SIGKILL)"),
    ({"ExitCode": 0}, "must return from execute()"),
    ({"ExitCode": 3}, "exited with code 3"),
    ({"Running": True}, "closed its protocol connection"),
    ({}, "the Docker engine did not say why"),
])
def test_each_way_a_container_ends_gets_its_own_words(state: dict[str, Any], words: str) -> None:
    from sandboxd.sandbox.docker.exits import exit_message

    message = exit_message(state, "96m", "last line")
    assert words in message
    assert message.endswith("Its last output:\nlast line") != bool(state.get("OOMKilled"))
