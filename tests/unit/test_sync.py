"""Seed sync: version rules of TOOLS.md "How Sync Works", atomic replacement and crash recovery."""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from sandboxd.tools import sync as sync_module
from sandboxd.tools.discovery import ToolCatalog
from sandboxd.tools.sync import SyncAction, recover, sync_tools


def write_tool(root: Path, name: str, version: int | None, *, files: dict[str, str] | None = None) -> Path:
    tool_dir = root / name
    tool_dir.mkdir(parents=True, exist_ok=True)
    version_line = f"version: {version}\n" if version is not None else ""
    (tool_dir / "TOOL.md").write_text(f"---\nname: {name}\ndescription: {name} tool.\n{version_line}---\n# {name}\n")
    (tool_dir / "index.ts").write_text(f"// {name} v{version}\n")
    for relative, content in (files or {}).items():
        (tool_dir / relative).parent.mkdir(parents=True, exist_ok=True)
        (tool_dir / relative).write_text(content)
    return tool_dir


def snapshot(directory: Path) -> dict[str, str]:
    """Every file under ``directory`` with its content (symlinks as their target)."""
    files = {}
    for path in sorted(directory.rglob("*")):
        relative = str(path.relative_to(directory))
        if path.is_symlink():
            files[relative] = "-> " + os.readlink(path)
        elif path.is_file():
            files[relative] = path.read_text()
    return files


@pytest.fixture
def seed(tmp_path: Path) -> Path:
    return tmp_path / "seed"


@pytest.fixture
def tools(tmp_path: Path) -> Path:
    return tmp_path / "data" / "tools"


def hidden(tools: Path) -> list[str]:
    return sorted(name for name in os.listdir(tools) if name.startswith("."))


# --- version rules -----------------------------------------------------------------------------


def test_a_first_sync_installs_every_seed_tool_and_creates_the_directory(seed: Path, tools: Path) -> None:
    write_tool(seed, "beta", 2, files={"bin/helper.py": "print(1)\n"})
    write_tool(seed, "alpha", 1)
    (seed / "alpha" / "link").symlink_to("index.ts")
    assert sync_tools(seed, tools) == [SyncAction("alpha", "installed", 1, None),
                                       SyncAction("beta", "installed", 2, None)]
    assert snapshot(tools / "alpha") == snapshot(seed / "alpha")
    assert snapshot(tools / "beta") == snapshot(seed / "beta")
    assert (tools / "alpha" / "link").is_symlink()  # copied as a link, not as the file it points to
    assert hidden(tools) == []


def test_a_higher_seed_version_replaces_the_whole_directory(seed: Path, tools: Path) -> None:
    write_tool(tools, "hello", 1, files={"old_only.txt": "stale", "index.ts": "// edited by hand"})
    write_tool(seed, "hello", 2, files={"bin/new.sh": "echo new\n"})
    assert sync_tools(seed, tools) == [SyncAction("hello", "updated", 2, 1)]
    assert snapshot(tools / "hello") == snapshot(seed / "hello")  # nothing of the old copy is left


@pytest.mark.parametrize(("seed_version", "installed_version"), [(2, 2), (1, 3), (None, 0), (None, 5), (0, None)])
def test_an_equal_or_lower_seed_version_keeps_the_installed_tool(seed: Path, tools: Path, seed_version: int | None,
                                                                   installed_version: int | None) -> None:
    write_tool(tools, "hello", installed_version, files={"index.ts": "// user edit\n"})
    write_tool(seed, "hello", seed_version)
    before = snapshot(tools / "hello")
    assert sync_tools(seed, tools) == [SyncAction("hello", "kept", seed_version or 0, installed_version or 0)]
    assert snapshot(tools / "hello") == before


def test_an_installed_tool_without_version_counts_as_zero(seed: Path, tools: Path) -> None:
    write_tool(tools, "hello", None)
    write_tool(seed, "hello", 1)
    assert sync_tools(seed, tools) == [SyncAction("hello", "updated", 1, 0)]


def test_an_installed_directory_without_a_manifest_counts_as_zero(seed: Path, tools: Path) -> None:
    (tools / "hello").mkdir(parents=True)
    (tools / "hello" / "junk").write_text("x")
    write_tool(seed, "hello", 1)
    assert sync_tools(seed, tools) == [SyncAction("hello", "updated", 1, 0)]
    assert snapshot(tools / "hello") == snapshot(seed / "hello")


def test_a_seed_tool_without_version_is_installed_when_missing(seed: Path, tools: Path) -> None:
    write_tool(seed, "hello", None)
    assert sync_tools(seed, tools) == [SyncAction("hello", "installed", 0, None)]


def test_a_quoted_seed_version_counts_as_zero(seed: Path, tools: Path) -> None:
    write_tool(tools, "hello", 1)
    (seed / "hello").mkdir(parents=True)
    (seed / "hello" / "TOOL.md").write_text("---\nname: hello\ndescription: D.\nversion: '9'\n---\n")
    assert sync_tools(seed, tools) == [SyncAction("hello", "kept", 0, 1)]


def test_only_seed_directories_with_a_manifest_count(seed: Path, tools: Path) -> None:
    write_tool(seed, "real", 1)
    (seed / "no_manifest").mkdir()
    write_tool(seed, ".hidden", 1)
    (seed / "README.md").write_text("seed notes")
    assert [a.name for a in sync_tools(seed, tools)] == ["real"]
    assert sorted(os.listdir(tools)) == ["real"]


def test_tools_not_in_the_seed_are_left_alone(seed: Path, tools: Path) -> None:
    write_tool(tools, "local", 1)
    (tools / ".git").mkdir()
    write_tool(seed, "hello", 1)
    sync_tools(seed, tools)
    assert sorted(os.listdir(tools)) == [".git", "hello", "local"]


def test_a_missing_seed_directory_is_a_clear_error(seed: Path, tools: Path) -> None:
    with pytest.raises(NotADirectoryError, match="seed tools directory .* does not exist"):
        sync_tools(seed, tools)


def test_sync_actions_print_as_the_cli_lines() -> None:
    assert str(SyncAction("hello", "installed", 1, None)) == "installed hello (v1)"
    assert str(SyncAction("x", "updated", 2, 1)) == "updated x (v1 → v2)"
    assert str(SyncAction("y", "kept", 2, 2)) == "kept y (v2, seed v2)"


def test_the_shipped_seed_installs_hello(tools: Path) -> None:
    seed = Path(__file__).resolve().parents[2] / "seed" / "tools"
    assert SyncAction("hello", "installed", 1, None) in sync_tools(seed, tools)
    assert ToolCatalog(tools.parent).get("hello") is not None


# --- atomicity and recovery --------------------------------------------------------------------


def test_a_leftover_old_copy_whose_tool_is_missing_is_put_back(seed: Path, tools: Path) -> None:
    # A crash between the two renames: the old tool is parked, the new one not yet in place.
    old = write_tool(tools, ".old-hello-0123abcd", 1)
    (old / "TOOL.md").write_text((old / "TOOL.md").read_text().replace(".old-hello-0123abcd", "hello"))
    write_tool(tools, ".new-hello-0123abcd", 2)
    expected = snapshot(old)
    recover(tools)
    assert hidden(tools) == [] and snapshot(tools / "hello") == expected


def test_a_leftover_old_copy_beside_its_tool_is_removed(tools: Path) -> None:
    # A crash after the swap, before the old copy was deleted: the new tool is in place.
    write_tool(tools, "hello", 2)
    write_tool(tools, ".old-hello-0123abcd", 1)
    expected = snapshot(tools / "hello")
    recover(tools)
    assert hidden(tools) == [] and snapshot(tools / "hello") == expected


def test_a_leftover_staging_copy_is_removed(tools: Path) -> None:
    write_tool(tools, "hello", 1)
    write_tool(tools, ".new-hello-0123abcd", 2)
    write_tool(tools, ".new-fresh-89abcdef", 1)  # a crash before a first install
    recover(tools)
    assert sorted(os.listdir(tools)) == ["hello"]


def test_hidden_entries_that_sync_did_not_make_are_kept(tools: Path) -> None:
    for name in (".git", ".old-notes", ".new-hello-XYZ"):
        (tools / name).mkdir(parents=True)
    recover(tools)
    assert hidden(tools) == [".git", ".new-hello-XYZ", ".old-notes"]


def test_sync_recovers_before_it_compares_versions(seed: Path, tools: Path) -> None:
    parked = write_tool(tools, ".old-hello-0123abcd", 3)
    (parked / "TOOL.md").write_text((parked / "TOOL.md").read_text().replace(".old-hello-0123abcd", "hello"))
    write_tool(seed, "hello", 2)
    assert sync_tools(seed, tools) == [SyncAction("hello", "kept", 2, 3)]


@pytest.mark.parametrize("failing_rename", [1, 2])
def test_a_crash_at_any_rename_leaves_the_old_or_the_new_tool(seed: Path, tools: Path,
                                                               monkeypatch: pytest.MonkeyPatch,
                                                               failing_rename: int) -> None:
    write_tool(tools, "hello", 1, files={"only_in_old.txt": "old"})
    write_tool(seed, "hello", 2, files={"only_in_new.txt": "new"})
    old, new = snapshot(tools / "hello"), snapshot(seed / "hello")
    real_rename, calls = os.rename, []

    def crashing_rename(source: object, target: object) -> None:
        calls.append(source)
        if len(calls) == failing_rename:
            raise KeyboardInterrupt("simulated crash")  # stands for the process dying here
        real_rename(source, target)

    monkeypatch.setattr(sync_module.os, "rename", crashing_rename)
    with pytest.raises(KeyboardInterrupt):
        sync_tools(seed, tools)
    monkeypatch.setattr(sync_module.os, "rename", real_rename)

    recover(tools)
    assert hidden(tools) == []
    assert snapshot(tools / "hello") in (old, new)


def test_a_failed_copy_leaves_no_staging_directory(seed: Path, tools: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    write_tool(tools, "hello", 1)
    write_tool(seed, "hello", 2)
    before = snapshot(tools / "hello")

    def full_disk(*args: object, **kwargs: object) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(sync_module, "_fsync_tree", full_disk)
    with pytest.raises(OSError):
        sync_tools(seed, tools)
    assert hidden(tools) == [] and snapshot(tools / "hello") == before


def test_leftovers_are_never_listed_as_tools(tools: Path) -> None:
    write_tool(tools, ".old-hello-0123abcd", 1)
    write_tool(tools, ".new-hello-0123abcd", 2)
    assert ToolCatalog(tools.parent).scan() == ([], [])


def test_concurrent_syncs_do_not_trip_over_each_other(seed: Path, tools: Path) -> None:
    for index in range(10):
        write_tool(seed, f"tool_{index}", 1, files={"bin/data.txt": "x" * 10_000})
    with ThreadPoolExecutor(4) as pool:
        for future in [pool.submit(sync_tools, seed, tools) for _ in range(4)]:
            future.result()  # re-raises what a sync raised
    assert hidden(tools) == []
    assert all(snapshot(tools / f"tool_{i}") == snapshot(seed / f"tool_{i}") for i in range(10))
