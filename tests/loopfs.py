"""A filesystem of its own for a test, on a loop device: always unmounted, detached and removed after."""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

MIB = 1 << 20


def loop_devices_usable(kind: str) -> str | None:
    """Why a ``kind`` loop filesystem cannot be made here, or None."""
    if os.geteuid() != 0:
        return "needs root (loop devices, mount)"
    for tool in (f"mkfs.{kind}", "losetup", "mount") + (("btrfs",) if kind == "btrfs" else ()):
        if shutil.which(tool) is None:
            return f"needs {tool} (scripts/ci-deps.sh installs it)"
    return None


def _run(*command: str) -> str:
    return subprocess.run(command, check=True, capture_output=True, text=True).stdout.strip()


@contextmanager
def loop_filesystem(where: Path, kind: str, size_mib: int) -> Iterator[Path]:
    """A ``kind`` filesystem of ``size_mib`` MiB mounted at ``where`` (btrfs with quota on); always taken down."""
    image = where.parent / f"{where.name}.{kind}.img"
    where.mkdir(parents=True, exist_ok=True)
    loop: str | None = None
    mounted = False
    try:
        with open(image, "wb") as file:
            file.truncate(size_mib * MIB)
        _run(f"mkfs.{kind}", "-q", str(image))
        loop = _run("losetup", "--find", "--show", str(image))
        _run("mount", loop, str(where))
        mounted = True
        if kind == "btrfs":
            _run("btrfs", "quota", "enable", str(where))
        yield where
    finally:
        if mounted and subprocess.run(["umount", str(where)], capture_output=True).returncode != 0:
            subprocess.run(["umount", "--lazy", str(where)], capture_output=True)
        if loop is not None:
            subprocess.run(["losetup", "--detach", loop], capture_output=True)
        image.unlink(missing_ok=True)
    assert f" {where} " not in Path("/proc/mounts").read_text(), f"{where} is still mounted"
    # The kernel lets go of a loop device shortly after its last user (a lazy unmount, udev's probe).
    deadline = time.monotonic() + 10
    while str(image) in _run("losetup", "--all") and time.monotonic() < deadline:
        time.sleep(0.1)
    assert str(image) not in _run("losetup", "--all"), f"{image} is still on a loop device"
