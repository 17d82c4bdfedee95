"""The Docker sandbox's container, read flag by flag from the pure spec function (no engine needed)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from sandboxd.config import AUTO_SANDBOX_ID, SandboxConfig
from sandboxd.sandbox.backend import SandboxSpec
from sandboxd.sandbox.docker.attach import STDOUT, Frames, frame
from sandboxd.sandbox.docker.spec import (
    CONTAINER_SHIM_DIR,
    LABEL_DATA_PATH,
    LABEL_INSTANCE,
    LABEL_MANAGED,
    LABEL_USER,
    ContainerSpec,
    container_spec,
    esbuild_source_spec,
)
from sandboxd.sandbox.mounts import Bind
from sandboxd.sandbox.docker.seccomp import sandbox_profile


class _NoEgress:
    def session(self, user: str, sandbox_id: str, context: Any) -> Any:
        raise AssertionError("not called by a pure function")


def make(tmp_path: Path, *, shim_dir: Path | None = Path("/run/s/x"), egress: bool = True,
         cache: bool = True, gvisor: bool = False, **settings: Any) -> ContainerSpec:
    spec = SandboxSpec(user="a@example.com", tools_dir=tmp_path / "tools", user_dir=tmp_path / "a@example.com",
                       user_tools_dir=tmp_path / "a@example.com" / "tools", email_db=None, root=tmp_path,
                       read_only_mounts=((tmp_path / "one", "/officer/user/tools/one"),),
                       transpile_cache=tmp_path / "cache" if cache else None,
                       egress=_NoEgress() if egress else None)
    binds = [Bind("/officer/user", str(tmp_path / "a@example.com"), read_only=False)]
    return container_spec(SandboxConfig(**settings), spec, instance="abc123", name="sandboxd-abc-1", binds=binds,
                          shim_dir=shim_dir, network="none", gvisor=gvisor)


def test_the_default_container_is_hardened_flag_by_flag(tmp_path: Path) -> None:
    host = make(tmp_path).host_config
    assert host["cap_drop"] == ["ALL"] and host["cap_add"] is None
    assert host["security_opt"] == ["no-new-privileges", f"seccomp={sandbox_profile()}"]
    assert host["read_only"] is True
    assert host["mem_limit"] == host["memswap_limit"] == "256m"  # no swap
    assert (host["cpu_period"], host["cpu_quota"]) == (100_000, 100_000)  # one CPU
    assert host["pids_limit"] == 128
    assert {(u["Name"], u["Soft"], u["Hard"]) for u in host["ulimits"]} == {("core", 0, 0), ("nofile", 4096, 4096)}
    assert host["init"] is True
    assert host["ipc_mode"] == "private"
    assert host["network_mode"] == "none"
    assert host["runtime"] is None
    assert host["log_config"]["Type"] == "none"  # a flood cannot fill the disk
    assert host["tmpfs"] == {"/tmp": "rw,nosuid,nodev,size=64m"}


def test_the_container_runs_as_the_sandbox_uid_labelled_as_this_daemon_s(tmp_path: Path) -> None:
    container = make(tmp_path).container
    assert container["user"] == f"{AUTO_SANDBOX_ID}:{AUTO_SANDBOX_ID}"
    assert container["labels"] == {LABEL_MANAGED: "1", LABEL_INSTANCE: "abc123", LABEL_USER: "a@example.com",
                                   LABEL_DATA_PATH: str(tmp_path)}
    assert container["network_disabled"] is True
    assert container["tty"] is False and container["working_dir"] == "/officer/user"


def test_settings_reach_their_flags(tmp_path: Path) -> None:
    made = make(tmp_path, gvisor=True, memory="96m", cpus=0.25, pids_limit=4096, runtime="runsc", read_only_root=False,
                no_new_privileges=False, cap_add=["NET_RAW"], user="1000:1000", init=False, tmp_size="8m")
    host, container = made.host_config, made.container
    assert (host["mem_limit"], host["memswap_limit"], host["cpu_quota"], host["pids_limit"]) == ("96m", "96m",
                                                                                                 25_000, 4096 + 256)
    assert host["runtime"] == "runsc" and host["read_only"] is False and host["security_opt"] is None
    assert host["cap_add"] == ["NET_RAW"] and host["init"] is False
    assert host["tmpfs"]["/tmp"].endswith("size=8m")
    assert container["user"] == "1000:1000"


def test_socket_mode_mounts_the_socket_directory_read_only_and_closes_stdin(tmp_path: Path) -> None:
    made = make(tmp_path)
    mounts = {m["Target"]: m for m in made.host_config["mounts"]}
    assert mounts[CONTAINER_SHIM_DIR]["Source"] == "/run/s/x" and mounts[CONTAINER_SHIM_DIR]["ReadOnly"] is True
    env = made.container["environment"]
    assert env["SANDBOXD_SHIM_SOCKET"] == f"{CONTAINER_SHIM_DIR}/shim.sock"
    assert env["SANDBOXD_EGRESS_SOCKET"] == f"{CONTAINER_SHIM_DIR}/egress.sock"
    assert made.container["stdin_open"] is False


def test_with_no_network_localhost_resolves_from_a_read_only_hosts_file(tmp_path: Path) -> None:
    """Docker leaves /etc/hosts empty in a container without a network: the socket directory's
    loopback-only file stands in (the browser relay is reached at localhost:PORT too)."""
    mounts = {m["Target"]: m for m in make(tmp_path).host_config["mounts"]}
    assert mounts["/etc/hosts"]["Source"] == "/run/s/x/hosts" and mounts["/etc/hosts"]["ReadOnly"] is True
    # On a network Docker writes the file itself; in attach mode there is no socket directory.
    for made in (make(tmp_path, network="sandboxd"), make(tmp_path, shim_dir=None)):
        assert "/etc/hosts" not in {m["Target"] for m in made.host_config["mounts"]}


def test_attach_mode_has_no_socket_directory_and_no_way_out(tmp_path: Path) -> None:
    made = make(tmp_path, shim_dir=None)
    assert CONTAINER_SHIM_DIR not in {m["Target"] for m in made.host_config["mounts"]}
    assert not {"SANDBOXD_SHIM_SOCKET", "SANDBOXD_EGRESS_SOCKET"} & set(made.container["environment"])
    assert made.container["stdin_open"] is True


def test_no_egress_socket_without_egress_and_no_cache_variable_without_a_cache(tmp_path: Path) -> None:
    env = make(tmp_path, egress=False, cache=False).container["environment"]
    assert "SANDBOXD_EGRESS_SOCKET" not in env and "SANDBOXD_TRANSPILE_CACHE" not in env
    assert make(tmp_path).container["environment"]["SANDBOXD_TRANSPILE_CACHE"] == "/officer/cache"


def test_the_user_folders_and_the_run_s_tool_are_mounted_as_given(tmp_path: Path) -> None:
    mounts = {m["Target"]: m for m in make(tmp_path).host_config["mounts"]}
    assert mounts["/officer/user"]["ReadOnly"] is False
    assert mounts["/officer/user/tools/one"]["ReadOnly"] is True
    assert mounts["/officer/user/tools/one"]["Source"] == str(tmp_path / "one")


def test_the_esbuild_source_container_is_offline_inert_and_labelled() -> None:
    spec = esbuild_source_spec("img:1", "abc123")
    assert spec["command"] == ["true"] and spec["entrypoint"] == [] and spec["network_disabled"] is True
    assert spec["labels"] == {LABEL_MANAGED: "1", LABEL_INSTANCE: "abc123"}


@pytest.mark.parametrize("cut", [1, 3, 8, 9, 13, 50])
def test_attach_frames_survive_reads_cut_anywhere(cut: int) -> None:
    stream = frame(STDOUT, b"ready\n") + frame(2, b"a tool's line") + frame(STDOUT, b"") + frame(2, b"x" * 20)
    frames = Frames()
    got = []
    for offset in range(0, len(stream), cut):
        got += frames.feed(stream[offset:offset + cut])
    assert got == [(STDOUT, b"ready\n"), (2, b"a tool's line"), (STDOUT, b""), (2, b"x" * 20)]


def test_runc_sandboxes_get_sandboxd_s_seccomp_profile_and_gvisor_keeps_its_own(tmp_path: Path) -> None:
    runc = make(tmp_path).host_config["security_opt"]
    profiles = [json.loads(opt.removeprefix("seccomp=")) for opt in runc if opt.startswith("seccomp=")]
    assert len(profiles) == 1 and profiles[0]["defaultAction"] == "SCMP_ACT_ERRNO"
    assert not any("ioctl" in rule["names"] and "args" not in rule for rule in profiles[0]["syscalls"])
    # Also without no-new-privileges: the profile does not depend on it.
    assert make(tmp_path, no_new_privileges=False).host_config["security_opt"] == [f"seccomp={sandbox_profile()}"]
    gvisor = make(tmp_path, gvisor=True, runtime="runsc").host_config["security_opt"]
    assert gvisor == ["no-new-privileges"]


def test_only_a_gvisor_sandbox_joins_its_folders_groups(tmp_path: Path) -> None:
    from sandboxd.sandbox.docker.spec import folder_groups

    binds = [Bind("/officer/user", "/data/a", read_only=False), Bind("/officer/tools", "/data/tools", read_only=True),
             Bind("/officer/data", "/mail/a", read_only=False)]
    groups = folder_groups(binds, {"/data/a": 997, "/data/tools": 997, "/mail/a": 1001}.__getitem__)
    assert groups == (997, 1001)
    assert make(tmp_path).host_config["group_add"] is None  # runc: the ACLs do it, no group is joined
    spec = SandboxSpec(user="a@example.com", tools_dir=tmp_path, user_dir=tmp_path, user_tools_dir=tmp_path,
                       email_db=None)
    made = container_spec(SandboxConfig(runtime="runsc"), spec, instance="i", name="n", binds=binds, shim_dir=None,
                          network="none", gvisor=True, groups=groups)
    assert made.host_config["group_add"] == ["997", "1001"]
    # The Sentry's and the gofer's own threads, and on ptrace a stub per sandbox thread, count
    # against the pids limit under gVisor.
    assert made.host_config["pids_limit"] == 128 + 256
