"""Shared unit-test fixtures."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

# This process may open TCP/UDP connections to loopback only: a test of the egress policy that
# let an address through by mistake fails here instead of sending a packet off the machine.
import tests.netguard.sitecustomize  # noqa: F401,E402


@pytest.fixture
def isolated_config(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """No SANDBOXD_* variable or system config file of this machine leaks into a command.

    Returns the empty config file that SANDBOXD_CONFIG now names.
    """
    for name in list(os.environ):
        if name.startswith("SANDBOXD_"):
            monkeypatch.delenv(name)
    empty = tmp_path / "empty-config.yaml"
    empty.write_text("")
    monkeypatch.setenv("SANDBOXD_CONFIG", str(empty))
    return empty
