"""Shared unit-test fixtures."""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Iterator

import pytest

# This process may open TCP/UDP connections to loopback only: a test of the egress policy that
# let an address through by mistake fails here instead of sending a packet off the machine.
import tests.netguard.sitecustomize  # noqa: F401,E402


SHORT_PREFIX = "sbd-"
_made: list[str] = []  # every directory named sbd-* this process created, whatever created it


def _record_short_dirs(event: str, args: tuple[object, ...]) -> None:
    # An audit hook sees this process's mkdirs only: a listing of /tmp would also see other runs' directories.
    if event == "os.mkdir" and os.path.basename(os.fsdecode(args[0])).startswith(SHORT_PREFIX):  # type: ignore[arg-type]
        _made.append(os.fsdecode(args[0]))  # type: ignore[arg-type]


sys.addaudithook(_record_short_dirs)


@pytest.fixture(autouse=True)
def no_short_dir_left() -> Iterator[None]:
    """A test that leaves a ``sbd-*`` directory behind fails (they piled up in /tmp, one per run of such a test)."""
    _made.clear()
    yield
    left = [path for path in _made if os.path.isdir(path)]
    for path in left:
        shutil.rmtree(path, ignore_errors=True)  # one leak fails one test, not every test after it
    assert not left, f"left behind {left}: use the short_dir fixture, or remove the directory in a finally"


@pytest.fixture
def short_dir() -> Iterator[Path]:
    """A directory with a short path, for unix sockets (at most 108 bytes; tmp_path is longer), removed after the test."""
    path = Path(tempfile.mkdtemp(prefix=SHORT_PREFIX))
    yield path
    shutil.rmtree(path, ignore_errors=True)


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
