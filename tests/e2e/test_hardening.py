"""Every hardening flag docs/security.md promises, read back from a container the daemon made.

test_image.py builds containers of its own; this asks the engine about the daemon's, so
that dropping any flag in DockerBackend._create turns a test red. What a flag does to a
tool is tested by the hostile catalogue (test_hostile.py); this is that it is there.
"""

from __future__ import annotations

from typing import Any

import pytest

from sandboxd.config import AUTO_SANDBOX_ID
from sandboxd.sandbox.docker.seccomp import sandbox_profile

from tests.e2e.conftest import GVISOR, Daemon

pytestmark = pytest.mark.docker

USER = "hardened@example.com"
TOKEN = "per-call-token-5d1e9c"
CONFIG = """\
sandbox:
  memory: 200m
  cpus: 0.5
  pids_limit: 77
  tmp_size: 12m
"""


@pytest.fixture
def inspected(make_daemon: Any, docker_api: Any) -> dict[str, Any]:
    daemon: Daemon = make_daemon(config=CONFIG)
    with daemon.client() as client:
        result = client.call_tool(USER, "env_probe", {}, env={"OFFICER_APIFY_TOKEN": TOKEN})
        assert result["status"] == "ok", result
    running = [c for c in daemon.containers(docker_api, **{"org.sandboxd.user": USER}) if c["State"] == "running"]
    assert running, "the call's sandbox (or its warm spare) should be running"
    return docker_api.api.inspect_container(running[0]["Id"])


def test_root_filesystem_capabilities_and_privileges(inspected: dict[str, Any]) -> None:
    host = inspected["HostConfig"]
    assert host["ReadonlyRootfs"] is True
    assert host["CapDrop"] == ["ALL"] and not host["CapAdd"]
    # sandboxd's seccomp profile under runc; runsc keeps its own filters (tests/e2e/test_seccomp.py).
    assert host["SecurityOpt"] == ["no-new-privileges"] + ([] if GVISOR else [f"seccomp={sandbox_profile()}"])
    assert host["Privileged"] is False
    assert inspected["Config"]["User"] == f"{AUTO_SANDBOX_ID}:{AUTO_SANDBOX_ID}"


def test_limits(inspected: dict[str, Any]) -> None:
    host = inspected["HostConfig"]
    assert host["Memory"] == 200 << 20
    assert host["MemorySwap"] == host["Memory"]  # no swap: the limit is the limit
    assert (host["CpuPeriod"], host["CpuQuota"]) == (100_000, 50_000)  # half a CPU
    assert host["PidsLimit"] == 77
    assert {(u["Name"], u["Soft"], u["Hard"]) for u in host["Ulimits"]} == {("core", 0, 0), ("nofile", 4096, 4096)}


def test_no_network_of_its_own(inspected: dict[str, Any]) -> None:
    """The default: no route out but the egress socket (test_egress.py shows what goes through it)."""
    assert inspected["HostConfig"]["NetworkMode"] == "none"
    assert inspected["Config"].get("NetworkDisabled") is True
    assert "SANDBOXD_EGRESS_SOCKET=/officer/run/egress.sock" in inspected["Config"]["Env"]


def test_init_ipc_log_and_scratch_space(inspected: dict[str, Any]) -> None:
    host = inspected["HostConfig"]
    assert host["Init"] is True
    assert host["IpcMode"] == "private"
    assert host["LogConfig"]["Type"] == "none"
    tmpfs = host["Tmpfs"]
    assert set(tmpfs) == {"/tmp"}  # /officer/data is the email database's folder on the host (below)
    for options in tmpfs.values():
        assert {"nosuid", "nodev"} <= set(options.split(","))
    assert "size=12m" in tmpfs["/tmp"].split(",")


def test_mounts_are_the_documented_ones_and_never_the_docker_socket(inspected: dict[str, Any]) -> None:
    mounts = {m["Destination"]: m for m in inspected["Mounts"]}
    assert set(mounts) == {"/officer/tools", "/officer/user", "/officer/user/tools", "/officer/run", "/officer/data",
                           "/etc/hosts"}
    for destination, writable in (("/officer/tools", False), ("/officer/user/tools", False), ("/officer/run", False),
                                  ("/etc/hosts", False), ("/officer/user", True), ("/officer/data", True)):
        assert mounts[destination]["Type"] == "bind" and mounts[destination]["RW"] is writable, destination
    assert mounts["/officer/data"]["Source"].endswith(f"/email/{USER}")  # this user's email folder alone
    assert not any("docker.sock" in m["Source"] for m in inspected["Mounts"])


def test_per_call_secrets_are_never_in_the_containers_config(inspected: dict[str, Any]) -> None:
    config = inspected["Config"]
    assert TOKEN not in repr(config["Env"]) and TOKEN not in repr(config.get("Cmd"))
    assert TOKEN not in repr(config.get("Entrypoint")) and TOKEN not in repr(config.get("Labels"))
    names = {entry.split("=", 1)[0] for entry in config["Env"]}
    assert "OFFICER_APIFY_TOKEN" not in names
