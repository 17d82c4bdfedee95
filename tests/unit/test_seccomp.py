"""sandboxd's seccomp profile (sandbox/docker/seccomp.py), read as runc will apply it: rules of a syscall are alternatives."""

from __future__ import annotations

import json
import random
from typing import Any

import pytest

from sandboxd.sandbox.docker.seccomp import (BASE_PROFILE, DENIED_IOCTLS, DENIED_SYSCALLS, allowed_ioctl_patterns,
                                      ioctl_denied, sandbox_profile)

MASK64 = (1 << 64) - 1


def profile() -> dict[str, Any]:
    return json.loads(sandbox_profile())


def ioctl_allowed_by(rules: list[dict[str, Any]], request: int) -> bool:
    """What libseccomp's filter answers for ioctl(fd, request): the 64-bit argument against each rule."""
    for rule in rules:
        if "ioctl" not in rule["names"] or rule["action"] != "SCMP_ACT_ALLOW":
            continue
        if "args" not in rule:
            return True
        (arg,) = rule["args"]
        assert arg["index"] == 1 and arg["op"] == "SCMP_CMP_MASKED_EQ"
        if request & MASK64 & arg["value"] == arg["valueTwo"]:
            return True
    return False


@pytest.mark.parametrize("request_number", [
    0x40086602,  # FS_IOC_SETFLAGS
    0x40046602,  # FS_IOC32_SETFLAGS
    0x80086601,  # FS_IOC_GETFLAGS
    0x401C5820,  # FS_IOC_FSSETXATTR
    0x801C581F,  # FS_IOC_FSGETXATTR
    0x5000940E,  # BTRFS_IOC_SUBVOL_CREATE
    0x50009401,  # BTRFS_IOC_SNAP_CREATE
    0x50009417,  # BTRFS_IOC_SNAP_CREATE_V2
    0x5000940F,  # BTRFS_IOC_SNAP_DESTROY
    0x4010942A,  # BTRFS_IOC_QGROUP_CREATE
    0x40049409,  # FICLONE (BTRFS_IOC_CLONE)
])
@pytest.mark.parametrize("high", [0, 0xFFFFFFFF00000000, 0x1_00000000, 0x80000000_00000000])
def test_the_quota_escaping_ioctls_are_denied_whatever_the_high_bits(request_number: int, high: int) -> None:
    assert ioctl_denied(high | request_number)
    assert not ioctl_allowed_by(profile()["syscalls"], high | request_number)


@pytest.mark.parametrize("request_number", [
    0x5401, 0x5402, 0x5403, 0x5404,  # TCGETS, TCSETS, TCSETSW, TCSETSF
    0x5413, 0x5414,  # TIOCGWINSZ, TIOCSWINSZ
    0x540F, 0x5410,  # TIOCGPGRP, TIOCSPGRP
    0x541B, 0x5421, 0x5450, 0x5451, 0x5452,  # FIONREAD, FIONBIO, FIONCLEX, FIOCLEX, FIOASYNC
    0x8912, 0x8913, 0x8915, 0x8933, 0x8927,  # SIOCGIFCONF, SIOCGIFFLAGS, SIOCGIFADDR, SIOCGIFINDEX, SIOCGIFHWADDR
    0xC020660B,  # FS_IOC_FIEMAP
    0x80087601,  # FS_IOC_GETVERSION
    0x40045402,  # TIOCSPTLCK... a _IOW on type 'T'
    0x80045430,  # TIOCGPTN
])
def test_the_ioctls_tools_use_stay_allowed(request_number: int) -> None:
    assert not ioctl_denied(request_number)
    assert ioctl_allowed_by(profile()["syscalls"], request_number)
    assert ioctl_allowed_by(profile()["syscalls"], 0xFFFFFFFF00000000 | request_number)


def test_the_rules_allow_exactly_what_the_denied_patterns_leave() -> None:
    # Every type and number byte, under a few directions, sizes and high bits.
    rules = profile()["syscalls"]
    rng = random.Random(35)
    for low in range(1 << 16):
        upper = rng.choice([0, 0x4008, 0x8004, 0xC018, 0x3FFF, 0xFFFF]) << 16
        high = rng.choice([0, 0xFFFFFFFF00000000, 0x12345678_00000000])
        request = high | upper | low
        assert ioctl_allowed_by(rules, request) is not ioctl_denied(request), hex(request)


def test_the_patterns_are_disjoint_and_few() -> None:
    patterns = allowed_ioctl_patterns(list(DENIED_IOCTLS.values()))
    assert len(patterns) < 64  # one filter rule each
    for i, (mask, value) in enumerate(patterns):
        assert mask <= 0xFFFFFFFF and value & ~mask == 0
        for other_mask, other_value in patterns[i + 1:]:
            assert (value ^ other_value) & mask & other_mask != 0


def test_denied_syscalls_are_allowed_by_no_rule_and_refused_with_eperm() -> None:
    rules = profile()["syscalls"]
    allowed = {name for rule in rules if rule["action"] == "SCMP_ACT_ALLOW" for name in rule["names"]}
    assert not allowed & set(DENIED_SYSCALLS)
    (refusal,) = [rule for rule in rules if set(DENIED_SYSCALLS) <= set(rule["names"])]
    assert refusal["action"] == "SCMP_ACT_ERRNO" and refusal["errnoRet"] == 1  # EPERM


def test_everything_else_is_docker_s_default_unchanged() -> None:
    base = json.loads(BASE_PROFILE.read_text())
    ours = profile()
    assert {k: v for k, v in ours.items() if k != "syscalls"} == {k: v for k, v in base.items() if k != "syscalls"}
    removed = set(DENIED_SYSCALLS) | {"ioctl"}

    def allowed_elsewhere(rules: list[dict[str, Any]]) -> set[tuple[str, str]]:
        return {(name, json.dumps({k: v for k, v in rule.items() if k != "names"}, sort_keys=True))
                for rule in rules for name in rule["names"] if name not in removed}

    assert allowed_elsewhere(ours["syscalls"]) == allowed_elsewhere(base["syscalls"])
