"""packaging/: the systemd units verify, and agree with the example config and with each other."""

from __future__ import annotations

import configparser
import shutil
import subprocess
from pathlib import Path

import pytest

from sandboxd.config import RUNNER_IMAGE, load_config

REPO = Path(__file__).resolve().parents[2]
PACKAGING = REPO / "packaging"


def unit(name: str) -> configparser.ConfigParser:
    # strict=False: systemd allows a directive more than once (SystemCallFilter=).
    parser = configparser.ConfigParser(strict=False, interpolation=None, delimiters=("=",))
    parser.optionxform = str  # type: ignore[assignment,method-assign]
    parser.read(PACKAGING / "systemd" / name)
    return parser


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="systemd-analyze missing; scripts/ci-deps.sh installs it")
def test_systemd_analyze_verify_accepts_the_units_as_shipped() -> None:
    units = sorted(str(p) for p in (PACKAGING / "systemd").iterdir())
    assert [Path(u).name for u in units] == ["sandboxd-quota.socket", "sandboxd-quota@.service", "sandboxd.service",
                                             "sandboxd.socket"]
    proc = subprocess.run(["systemd-analyze", "verify", *units], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and proc.stderr.strip() == "", proc.stderr


def test_make_install_points_execstart_at_the_installed_binary() -> None:
    makefile = (REPO / "Makefile").read_text()
    assert "ExecStart=/usr/bin/env sandboxd serve" in (PACKAGING / "systemd" / "sandboxd.service").read_text()
    assert "s|/usr/bin/env sandboxd|$(PREFIX)/bin/sandboxd|" in makefile


def test_the_quota_helper_is_installed_with_only_the_capabilities_it_needs() -> None:
    makefile = (REPO / "Makefile").read_text()
    helper = unit("sandboxd-quota@.service")["Service"]
    assert helper["ExecStart"].startswith("/usr/bin/env python3 -m sandboxd.storage.helper")
    assert "s|/usr/bin/env python3|$(PREFIX)/bin/python|' packaging/systemd/sandboxd-quota@.service" in makefile
    assert helper["CapabilityBoundingSet"].split() == ["CAP_SYS_ADMIN", "CAP_CHOWN", "CAP_DAC_OVERRIDE", "CAP_KILL"]
    assert helper["StandardInput"] == "socket" and helper["PrivateNetwork"] == "yes"
    socket_unit = unit("sandboxd-quota.socket")["Socket"]
    assert socket_unit["Accept"] == "yes" and socket_unit["SocketMode"] == "0600"
    # Only the daemon's account may connect, and the helper serves that one (SO_PEERCRED): the same in all three.
    daemon_user = unit("sandboxd.service")["Service"]["User"]
    assert socket_unit["SocketUser"] == daemon_user and helper["ExecStart"].endswith(f"--daemon-user {daemon_user}")
    assert socket_unit["ListenStream"] == str(load_config(environ={}).storage.helper_socket)


def test_the_example_config_loads_and_matches_the_units() -> None:
    config = load_config(PACKAGING / "config.yaml", environ={})
    service, socket_unit = unit("sandboxd.service")["Service"], unit("sandboxd.socket")["Socket"]
    assert service["Type"] == "notify" and service["NotifyAccess"] == "main"
    assert service["ExecStart"].endswith("serve --config /etc/sandboxd/config.yaml")
    assert service["ExecReload"] == """/bin/sh -c 'kill -HUP "$$MAINPID"'"""
    assert "docker" in service["SupplementaryGroups"].split()
    # The daemon and the socket unit must agree on the socket, or clients look in the wrong place.
    assert socket_unit["ListenStream"] == str(config.socket)
    assert socket_unit["SocketGroup"] == config.socket_group == service["Group"]
    assert int(socket_unit["SocketMode"], 8) == config.socket_mode == 0o660
    assert str(config.socket.parent) == "/run/" + service["RuntimeDirectory"]
    assert str(config.data_path) == "/var/lib/" + service["StateDirectory"]
    # Shutdown lets calls finish for the grace, then cancels (5 s) and removes containers: systemd must wait longer.
    assert int(service["TimeoutStopSec"].rstrip("s")) >= config.pool.shutdown_grace_s + 5 + 30
    assert config.metrics.listen is None and config.allowed_uids == [] and config.log_format == "json"
    # A pinned image goes stale at the next release (0.2.0 stayed here after 0.3.0: a clean host has no such image).
    assert config.sandbox.image == RUNNER_IMAGE


def test_sysusers_creates_the_user_the_unit_runs_as() -> None:
    lines = [line.split() for line in (PACKAGING / "sysusers.d" / "sandboxd.conf").read_text().splitlines()
             if line.strip() and not line.startswith("#")]
    assert lines[0][:2] == ["u", unit("sandboxd.service")["Service"]["User"]]
