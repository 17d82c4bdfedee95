"""sandboxd's seccomp profile for runc sandboxes: Docker's default, minus what no tool needs.

The base, ``seccomp-docker-default.json``, is Docker's default profile byte for byte:
``profiles/seccomp/default.json`` of github.com/moby/profiles v0.2.3 (Apache-2.0), as
vendored in moby/moby at b985e2313a86. This module derives sandboxd's profile from it:

- ``ioctl`` is no longer allowed unconditionally. Allow rules match the request number
  with ``SCMP_CMP_MASKED_EQ`` on its low 32 bits only, the bits the kernel reads (its
  ``cmd`` is an unsigned int, while seccomp compares all 64): a request with high bits
  set is judged as the kernel will run it. The rules cover every request but
  ``DENIED_IOCTLS``: the calls that change an inode's flags or its ext4/XFS project ID,
  and every btrfs ioctl (a nested subvolume or snapshot escapes a qgroup limit).
- ``DENIED_SYSCALLS`` are allowed by no rule (not even behind a capability) and get
  EPERM explicitly (docs/security.md gives the reason for each).

gVisor sandboxes keep runsc's own filters: the profile is for runc only (spec.py).
"""

from __future__ import annotations

import errno
import functools
import json
from pathlib import Path
from typing import Any

BASE_PROFILE = Path(__file__).with_name("seccomp-docker-default.json")

# (mask, value) over the request's low 32 bits: a request r is denied when r & mask == value.
# An ioctl number is dir(2 bits) size(14) type(8) nr(8); the size and direction are ignored so
# that the 32-bit and differently sized variants of a request are denied with it.
DENIED_IOCTLS: dict[str, tuple[int, int]] = {
    "FS_IOC_GETFLAGS": (0xFFFF, 0x6601),  # _IOR('f', 1, long)
    "FS_IOC_SETFLAGS": (0xFFFF, 0x6602),  # _IOW('f', 2, long): chattr, incl. clearing project inheritance
    "FS_IOC_FSGETXATTR": (0xFFFF, 0x581F),  # _IOR('X', 31, struct fsxattr)
    "FS_IOC_FSSETXATTR": (0xFFFF, 0x5820),  # _IOW('X', 32, struct fsxattr): sets the project ID
    "BTRFS_IOC_*": (0xFF00, 0x9400),  # type 0x94: subvolumes, snapshots, clones, qgroups, labels
}

DENIED_SYSCALLS = (
    "file_getattr", "file_setattr",  # the FS_IOC_FS[GS]ETXATTR of Linux 6.17, without an ioctl
    "io_uring_setup", "io_uring_enter", "io_uring_register",
    "userfaultfd",
    "keyctl", "add_key", "request_key",
    "bpf",
    "perf_event_open",
)

_LOW32 = 0xFFFFFFFF
# The bits the denied patterns test, most significant first: the order the allowed space is split in.
_SPLIT_ORDER = tuple(range(31, -1, -1))


def _intersects(a: tuple[int, int], b: tuple[int, int]) -> bool:
    return (a[1] ^ b[1]) & a[0] & b[0] == 0


def _inside(cube: tuple[int, int], pattern: tuple[int, int]) -> bool:
    return pattern[0] & ~cube[0] == 0 and cube[1] & pattern[0] == pattern[1]


def allowed_ioctl_patterns(denied: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """(mask, value) patterns over 32 bits whose union is exactly what ``denied`` leaves.

    The 32-bit space is split bit by bit (a binary decision tree), keeping each part no
    denied pattern touches: a few dozen patterns, one seccomp rule each.
    """
    found: list[tuple[int, int]] = []

    def split(cube: tuple[int, int]) -> None:
        touching = [d for d in denied if _intersects(cube, d)]
        if not touching:
            found.append(cube)
            return
        if any(_inside(cube, d) for d in touching):
            return
        bit = next(1 << b for b in _SPLIT_ORDER if not cube[0] & (1 << b) and any(d[0] & (1 << b) for d in touching))
        split((cube[0] | bit, cube[1]))
        split((cube[0] | bit, cube[1] | bit))

    split((0, 0))
    return found


def ioctl_denied(request: int) -> bool:
    """Whether the profile refuses ``ioctl(fd, request, ...)``: what the kernel reads is the low 32 bits."""
    return any(request & _LOW32 & mask == value for mask, value in DENIED_IOCTLS.values())


def build_profile(base: dict[str, Any]) -> dict[str, Any]:
    """sandboxd's profile from Docker's (``base``, not modified)."""
    denied = set(DENIED_SYSCALLS) | {"ioctl"}
    syscalls: list[dict[str, Any]] = []
    for rule in base["syscalls"]:
        names = [name for name in rule["names"] if not (rule["action"] == "SCMP_ACT_ALLOW" and name in denied)]
        if names:
            syscalls.append({**rule, "names": names})
    # One rule per pattern, one condition each: the rules of a syscall are alternatives.
    for mask, value in allowed_ioctl_patterns(list(DENIED_IOCTLS.values())):
        syscalls.append({"names": ["ioctl"], "action": "SCMP_ACT_ALLOW",
                         "args": [{"index": 1, "value": mask, "valueTwo": value, "op": "SCMP_CMP_MASKED_EQ"}]})
    # Explicit, so that runc's ENOSYS stub for numbers past the profile's last never applies to them.
    syscalls.append({"names": list(DENIED_SYSCALLS), "action": "SCMP_ACT_ERRNO", "errnoRet": errno.EPERM})
    return {**base, "syscalls": syscalls}


@functools.cache
def sandbox_profile() -> str:
    """The profile as the engine takes it in ``security_opt``: ``seccomp=<this JSON>``."""
    return json.dumps(build_profile(json.loads(BASE_PROFILE.read_text())), separators=(",", ":"))
