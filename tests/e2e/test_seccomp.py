"""sandboxd's own seccomp profile under runc (issue 35, item 6).

Under Docker's default profile a tool can change an inode's flags or project ID
(FS_IOC_SETFLAGS, FS_IOC_FSSETXATTR: how an ext4/XFS project quota is left), make a
btrfs subvolume (which escapes a qgroup limit), and call io_uring. A hostile tool tries
each, the ioctls also with high bits set in the request (the kernel reads the low 32 bits),
on /officer/user and /tmp: every one gets EPERM, while the ioctls tools use still work.
Real daemon, real Docker, runc (gVisor filters syscalls in its own kernel).
"""

from __future__ import annotations

from typing import Any

import pytest

from tests.e2e.conftest import GVISOR
from tests.e2e.hostile_harness import call, install_hostile_tools

pytestmark = [pytest.mark.docker,
              pytest.mark.skipif(GVISOR, reason="runsc keeps its own filters; the profile is for runc")]

ATTACKER = "mallory@example.com"
ESCAPES = [f"{name} {where}{high}" for name in ("FS_IOC_SETFLAGS", "FS_IOC_FSSETXATTR", "BTRFS_IOC_SUBVOL_CREATE")
           for where in ("/officer/user", "/tmp") for high in ("", " high")]
SURFACE = ["io_uring_setup", "userfaultfd", "keyctl", "add_key", "bpf", "perf_event_open"]
NEEDED = ["TCGETS", "TIOCSWINSZ", "TIOCGWINSZ", "TIOCGWINSZ high", "FIONBIO", "FIOCLEX", "SIOCGIFCONF"]


def test_quota_escaping_ioctls_and_kernel_surface_get_eperm_while_tool_ioctls_work(make_daemon: Any) -> None:
    daemon = make_daemon(start=False)
    install_hostile_tools(daemon)
    daemon.start()
    with daemon.client() as client:
        result = call(client, ATTACKER, "kernel_prober")
    assert result["status"] == "ok", result
    report = result["details"]
    refused = {probe: report[probe] for probe in ESCAPES + SURFACE}
    assert set(refused.values()) == {"EPERM"}, refused
    # Linux 6.17's syscall for what FS_IOC_FSSETXATTR does: EPERM where runc's libseccomp knows
    # it, ENOSYS from runc's stub for syscalls past the profile's last where it does not.
    assert report["file_setattr"] in ("EPERM", "ENOSYS"), report
    assert {probe: report[probe] for probe in NEEDED} == {probe: "ok" for probe in NEEDED}, report
    assert report["FIONREAD"] == "ok 3", report
