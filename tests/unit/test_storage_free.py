"""`sandboxd storage free`: the operator's one command for a user over quota (storage/free.py, cli/storage_cmds.py)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from sandboxd.cli.main import main

MIB = 1 << 20
USER = "full@example.com"


@pytest.fixture
def data(tmp_path: Path) -> Path:
    data = tmp_path / "data"
    (data / USER / "cache" / "deep").mkdir(parents=True)
    (data / USER / "cache" / "deep" / "blob").write_bytes(b"c" * 3 * MIB)
    (data / USER / "notes").write_bytes(b"n")
    (data / "email" / USER).mkdir(parents=True)
    (data / "email" / USER / "emails.db").write_bytes(b"e" * MIB)
    (tmp_path / "config.yaml").write_text("storage:\n  quota_bytes: 2m\n")
    os.sync()
    return data


def _free(data: Path, *paths: str) -> int:
    return main(["storage", "free", USER, *paths, "--config", str(data.parent / "config.yaml"), "--data-path", str(data)])


def test_it_lists_the_biggest_entries_as_a_sandbox_sees_them_then_removes_one(data: Path,
                                                                              capsys: pytest.CaptureFixture[str]) -> None:
    assert _free(data) == 1  # over quota
    out = capsys.readouterr().out
    lines = out.splitlines()
    assert lines[0].startswith(f"{USER} holds 4.0 MiB of 2.0 MiB")
    assert "/officer/user/cache" in lines[1] and f"(sandboxd storage free {USER} /officer/user/cache)" in lines[1]
    assert "/officer/data/emails.db" in lines[2]
    assert _free(data, "/officer/user/cache") == 0  # under it now
    assert capsys.readouterr().out.startswith(f"removed /officer/user/cache\n{USER} holds 1.0 MiB")
    assert sorted(os.listdir(data / USER)) == ["notes"]


def test_a_planted_link_is_removed_itself_never_followed(data: Path, tmp_path: Path,
                                                         capsys: pytest.CaptureFixture[str]) -> None:
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "precious").write_text("not the user's")
    os.symlink(elsewhere, data / USER / "link")
    assert _free(data, "/officer/user/link/precious") == 1
    assert "symbolic link" in capsys.readouterr().err
    assert _free(data, "/officer/user/link") == 1  # the link goes; the user is still over quota
    assert (elsewhere / "precious").read_text() == "not the user's" and not (data / USER / "link").exists()


@pytest.mark.parametrize("path", ["/officer/user", "/officer/user/../other@example.com", "/etc/passwd", "cache"])
def test_paths_outside_the_users_folders_are_refused_before_anything_is_removed(
        data: Path, path: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert _free(data, "/officer/user/cache", path) == 2
    assert "is not a path below /officer/user or /officer/data" in capsys.readouterr().err
    assert (data / USER / "cache").is_dir()  # the valid one before it was not removed either
