"""Several real sandboxd daemons, each a host of one cluster: their own data path (optionally a btrfs
loop filesystem of its own), socket and ``cluster:`` section, all pointed at one test etcd.

``make_hosts(["a", "b"])`` starts them; each is stopped and checked for leftover containers after.
Their ``cluster.listen`` is null unless ``extra`` sets it: the directory needs no certificate, so
the tls paths name files that need not exist until a test turns the listener on.
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any, Iterator

import pytest

from tests.cluster.etcd import Etcd
from tests.e2e.conftest import Daemon
from tests.loopfs import loop_devices_usable, loop_filesystem


def cluster_section(node: str, etcd: Etcd, *, lease_s: int = 2, advertise: str | None = None, extra: str = "") -> str:
    """A ``cluster:`` section for host ``node``; ``extra``: more of its keys, indented by four spaces."""
    return (f"cluster:\n  node: {node}\n  etcd: [{etcd.url}]\n  lease_s: {lease_s}\n"
            f"  advertise: '{advertise or f'{node}.test:7443'}'\n"
            f"  tls: {{cert: /nonexistent/{node}.pem, key: /nonexistent/{node}.key, ca: /nonexistent/ca.pem}}\n"
            f"{extra}")


@pytest.fixture
def make_hosts(tmp_path: Path, docker_api: Any, etcd: Etcd) -> Iterator[Any]:
    """Factory: make_hosts(["a", "b"], lease_s=2, config="pool:\\n  min_idle: 0\\n", btrfs_mib=None) → started
    Daemons, in the order named. ``btrfs_mib``: each on a btrfs loop filesystem of that size (quota on)."""
    hosts: list[Daemon] = []
    with contextlib.ExitStack() as mounts:

        def factory(names: list[str], *, lease_s: int = 2, config: str = "", btrfs_mib: int | None = None,
                    start: bool = True) -> list[Daemon]:
            made = []
            for name in names:
                root = tmp_path / f"host-{name}"
                if btrfs_mib is not None:
                    why = loop_devices_usable("btrfs")
                    if why is not None:
                        pytest.skip(f"a btrfs loop filesystem {why}")
                    mounts.enter_context(loop_filesystem(root / "data", "btrfs", btrfs_mib))
                host = Daemon(root, config=config + cluster_section(name, etcd, lease_s=lease_s))
                hosts.append(host)
                made.append(host)
            return [host.start() for host in made] if start else made

        try:
            yield factory
        finally:
            for host in hosts:
                if host.proc is not None:
                    host.stop()
                host.remove_leftovers(docker_api)
