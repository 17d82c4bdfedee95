"""Discovery: global then user tools, skipped directories, symlink refusal, and the manifest cache."""

from __future__ import annotations

import os
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from sandboxd.errors import InvalidParams
from sandboxd.tools import discovery, freshness, inotify
from sandboxd.tools.discovery import Skipped, Tool, ToolCatalog

USER = "alice@example.com"


def write_tool(root: Path, dirname: str, *, name: str | None = None, version: int = 1,
               description: str = "Does things.", entry: str | None = "index.ts", manifest: str | None = None) -> Path:
    tool_dir = root / dirname
    tool_dir.mkdir(parents=True, exist_ok=True)
    if manifest is None:
        manifest = (f"---\nname: {name or dirname}\ndescription: {description}\nversion: {version}\n"
                    "inputs:\n  q:\n    type: string\n    description: Query.\n---\n# Doc\n")
    (tool_dir / "TOOL.md").write_text(manifest)
    if entry:
        (tool_dir / entry).write_text("export async function execute() { return { content: [] }; }\n")
    return tool_dir


@pytest.fixture
def data(tmp_path: Path) -> Path:
    return tmp_path / "data"


def global_root(data: Path) -> Path:
    return data / "tools"


def user_root(data: Path, user: str = USER) -> Path:
    return data / user / "tools"


def names(tools: list[Tool]) -> list[str]:
    return [tool.name for tool in tools]


def skipped_dirs(skipped: list[Skipped]) -> list[str]:
    return [entry.dir.name for entry in skipped]


# --- listing -----------------------------------------------------------------------------------


def test_a_missing_data_path_has_no_tools(data: Path) -> None:
    assert ToolCatalog(data).scan(USER) == ([], [])


def test_global_tools_are_listed_by_name(data: Path) -> None:
    for dirname in ("zeta", "alpha", "mid"):
        write_tool(global_root(data), dirname)
    tools = ToolCatalog(data).tools()
    assert names(tools) == ["alpha", "mid", "zeta"]
    assert {tool.source for tool in tools} == {"global"}
    assert tools[0].dir == global_root(data) / "alpha" and tools[0].entry == global_root(data) / "alpha/index.ts"


def test_user_tools_are_added_and_override_global_ones(data: Path) -> None:
    write_tool(global_root(data), "shared", version=1)
    write_tool(global_root(data), "only_global")
    write_tool(user_root(data), "shared", version=7)
    write_tool(user_root(data), "mine")
    catalog = ToolCatalog(data)
    tools = catalog.tools(USER)
    assert [(t.name, t.source) for t in tools] == [("mine", "user"), ("only_global", "global"), ("shared", "user")]
    assert catalog.get("shared", USER).manifest.version == 7
    assert catalog.get("shared").manifest.version == 1  # without a user, only global tools
    assert catalog.get("mine", "bob@example.com") is None  # one user's tools are not another's


def test_get_an_unknown_tool_is_none(data: Path) -> None:
    write_tool(global_root(data), "hello")
    assert ToolCatalog(data).get("nope") is None


@pytest.mark.parametrize("user", ["not-an-email", "../etc@x", "", "a" * 251 + "@b.c"])
def test_a_malformed_user_is_invalid_params(data: Path, user: str) -> None:
    with pytest.raises(InvalidParams):
        ToolCatalog(data).tools(user)


def test_to_protocol_is_the_protocol_tool_object(data: Path) -> None:
    write_tool(global_root(data), "hello")
    tool = ToolCatalog(data).tools()[0]
    assert tool.to_protocol() == {
        "name": "hello", "label": "hello", "description": "Does things.", "version": 1, "language": "typescript",
        "source": "global",
        "inputSchema": {"type": "object", "properties": {"q": {"type": "string", "description": "Query."}},
                        "required": ["q"], "additionalProperties": False},
        "documentation": "# Doc",
        "permissions": None,
    }
    assert list(tool.to_protocol()) == ["name", "label", "description", "version", "language", "source",
                                        "inputSchema", "documentation", "permissions"]


def test_to_protocol_hands_out_copies_of_the_schema(data: Path) -> None:
    write_tool(global_root(data), "hello")
    tool = ToolCatalog(data).tools()[0]
    tool.to_protocol()["inputSchema"]["required"].append("oops")
    assert tool.schema["required"] == ["q"]


# --- entry files and skipped directories -------------------------------------------------------


def test_index_ts_is_preferred_over_index_js(data: Path) -> None:
    tool_dir = write_tool(global_root(data), "both")
    (tool_dir / "index.js").write_text("")
    write_tool(global_root(data), "js_only", entry="index.js")
    tools = ToolCatalog(data).tools()
    assert [t.entry.name for t in tools] == ["index.ts", "index.js"]


def test_directories_without_manifest_or_entry_are_skipped_with_a_fix(data: Path) -> None:
    write_tool(global_root(data), "no_entry", entry=None)
    (global_root(data) / "no_manifest").mkdir()
    (global_root(data) / "no_manifest" / "index.ts").write_text("")
    write_tool(global_root(data), "ok")
    tools, skipped = ToolCatalog(data).scan()
    assert names(tools) == ["ok"]
    assert skipped_dirs(skipped) == ["no_entry", "no_manifest"]
    assert "no entry file (index.ts or index.js)" in skipped[0].problems[0].message
    assert skipped[1].problems[0].message == "no TOOL.md"
    assert all(p.fix for entry in skipped for p in entry.problems)


def test_a_directory_with_manifest_errors_is_skipped_with_all_of_them(data: Path) -> None:
    write_tool(global_root(data), "broken", manifest="---\nname: Broken\nversion: '2'\n---\n")
    tools, skipped = ToolCatalog(data).scan()
    assert tools == []
    assert [p.field for p in skipped[0].problems] == ["description", "name", "version"]


def test_hidden_directories_and_plain_files_are_ignored_silently(data: Path) -> None:
    write_tool(global_root(data), ".new-hello-0123abcd")
    write_tool(global_root(data), ".hidden", entry=None)
    (global_root(data) / "README.md").write_text("notes")
    write_tool(global_root(data), "hello")
    assert ToolCatalog(data).scan() == (ToolCatalog(data).tools(), [])
    assert names(ToolCatalog(data).tools()) == ["hello"]


def test_the_same_name_twice_in_one_root_the_last_directory_wins(data: Path) -> None:
    write_tool(global_root(data), "a_first", name="dup", description="First.")
    write_tool(global_root(data), "b_second", name="dup", description="Second.")
    tools, skipped = ToolCatalog(data).scan()
    assert [t.manifest.description for t in tools] == ["Second."]
    assert skipped_dirs(skipped) == ["a_first"]
    assert "also declared in b_second/" in skipped[0].problems[0].message


def test_a_tools_root_that_is_a_file_is_reported(data: Path) -> None:
    data.mkdir()
    global_root(data).write_text("not a directory")
    tools, skipped = ToolCatalog(data).scan()
    assert tools == [] and skipped[0].dir == global_root(data)


# --- symlinks ----------------------------------------------------------------------------------


def test_a_tool_directory_linked_from_outside_the_root_is_refused(data: Path, tmp_path: Path) -> None:
    elsewhere = write_tool(tmp_path / "elsewhere", "sneaky")
    global_root(data).mkdir(parents=True)
    (global_root(data) / "sneaky").symlink_to(elsewhere)
    tools, skipped = ToolCatalog(data).scan()
    assert tools == []
    assert "outside the tools directory" in skipped[0].problems[0].message


def test_a_tool_directory_linked_within_the_root_is_used(data: Path) -> None:
    write_tool(global_root(data), "real", name="aliased")
    (global_root(data) / "zz_link").symlink_to(global_root(data) / "real")
    tools, skipped = ToolCatalog(data).scan()
    assert names(tools) == ["aliased"] and tools[0].dir.name == "zz_link"
    assert skipped_dirs(skipped) == ["real"]  # the same name twice: reported, not hidden


@pytest.mark.parametrize("linked", ["TOOL.md", "index.ts"])
def test_a_manifest_or_entry_linked_from_outside_the_root_is_refused(data: Path, tmp_path: Path, linked: str) -> None:
    source = write_tool(tmp_path / "elsewhere", "x")
    tool_dir = write_tool(global_root(data), "x")
    (tool_dir / linked).unlink()
    (tool_dir / linked).symlink_to(source / linked)
    tools, skipped = ToolCatalog(data).scan()
    assert tools == []
    assert any("outside the tools directory" in p.message for p in skipped[0].problems)


def test_a_user_tool_linking_to_a_global_tool_is_refused(data: Path) -> None:
    write_tool(global_root(data), "hello")
    user_root(data).mkdir(parents=True)
    (user_root(data) / "hello").symlink_to(global_root(data) / "hello")
    tools, skipped = ToolCatalog(data).scan(USER)
    assert [(t.name, t.source) for t in tools] == [("hello", "global")]
    assert [(s.dir.name, s.source) for s in skipped] == [("hello", "user")]


def test_a_broken_manifest_link_is_skipped_not_raised(data: Path) -> None:
    tool_dir = write_tool(global_root(data), "dangling")
    (tool_dir / "TOOL.md").unlink()
    (tool_dir / "TOOL.md").symlink_to(tool_dir / "gone.md")
    tools, skipped = ToolCatalog(data).scan()
    assert tools == [] and "does not exist" in skipped[0].problems[-1].message


# --- freshness and caching ---------------------------------------------------------------------


@pytest.fixture
def parse_count(monkeypatch: pytest.MonkeyPatch) -> list[Path]:
    parsed: list[Path] = []
    real = discovery.parse_manifest

    def counting(path: Path, **kwargs: object):  # type: ignore[no-untyped-def]
        parsed.append(path)
        return real(path, **kwargs)

    monkeypatch.setattr(discovery, "parse_manifest", counting)
    return parsed


def test_an_unchanged_tree_is_not_parsed_again(data: Path, parse_count: list[Path]) -> None:
    for dirname in ("a", "b", "c"):
        write_tool(global_root(data), dirname)
    write_tool(user_root(data), "mine")
    catalog = ToolCatalog(data)
    first = catalog.tools(USER)
    assert len(parse_count) == 4
    second = catalog.tools(USER)
    assert len(parse_count) == 4
    assert second == first and second[0].schema is first[0].schema  # the same Tool objects, schema computed once


def test_an_edited_tool_is_parsed_again_and_seen(data: Path, parse_count: list[Path]) -> None:
    write_tool(global_root(data), "a")
    write_tool(global_root(data), "b")
    catalog = ToolCatalog(data)
    catalog.tools()
    write_tool(global_root(data), "b", description="Now does other things.")
    tools = catalog.tools()
    assert parse_count[2:] == [global_root(data) / "b" / "TOOL.md"]
    assert tools[1].manifest.description == "Now does other things."


def test_an_edit_keeping_size_and_inode_is_seen_by_its_mtime(data: Path, parse_count: list[Path]) -> None:
    tool_dir = write_tool(global_root(data), "a", version=1)
    catalog = ToolCatalog(data)
    catalog.tools()
    manifest = tool_dir / "TOOL.md"
    inode = manifest.stat().st_ino
    with manifest.open("r+") as file:  # in place: same inode, same size
        text = file.read()
        file.seek(0)
        file.write(text.replace("version: 1", "version: 2"))
    info = manifest.stat()
    os.utime(manifest, ns=(info.st_atime_ns, info.st_mtime_ns + 1_000_000))
    assert manifest.stat().st_ino == inode
    assert catalog.tools()[0].manifest.version == 2 and len(parse_count) == 2


def test_added_and_removed_tools_are_seen_without_a_restart(data: Path, parse_count: list[Path]) -> None:
    write_tool(global_root(data), "a")
    catalog = ToolCatalog(data)
    assert names(catalog.tools()) == ["a"]
    write_tool(user_root(data), "new")
    assert names(catalog.tools(USER)) == ["a", "new"]
    (user_root(data) / "new" / "index.ts").unlink()
    assert names(catalog.tools(USER)) == ["a"]
    assert len(parse_count) == 2  # removing the entry file needs no re-parse


def test_a_manifest_that_gets_fixed_comes_back(data: Path) -> None:
    write_tool(global_root(data), "a", manifest="---\nname: a\n---\n")
    catalog = ToolCatalog(data)
    assert catalog.tools() == []
    write_tool(global_root(data), "a")
    assert names(catalog.tools()) == ["a"]


def test_listing_from_many_threads_gives_one_answer(data: Path) -> None:
    for index in range(20):
        write_tool(global_root(data), f"tool_{index:02d}")
    catalog = ToolCatalog(data)

    def list_ten_times() -> list[list[str]]:
        return [names(catalog.tools()) for _ in range(10)]

    with ThreadPoolExecutor(8) as pool:
        futures = [pool.submit(list_ten_times) for _ in range(8)]
    results = [listing for future in futures for listing in future.result()]  # result() re-raises a thread's error
    assert all(result == [f"tool_{i:02d}" for i in range(20)] for result in results) and len(results) == 80


# --- the per-root snapshot (a stat fingerprint instead of a full scan) ------------------------


def no_racy_window(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(freshness, "RACY_WINDOW_NS", 0)
    monkeypatch.setattr(freshness, "RACY_WINDOW_FINE_NS", 0)


@pytest.fixture
def scan_count(monkeypatch: pytest.MonkeyPatch) -> list[Path]:
    """Tool directories inspected by a full scan; trusts snapshots at once (no racy window)."""
    no_racy_window(monkeypatch)
    inspected: list[Path] = []
    real = discovery.inspect_tool_dir

    def counting(tool_dir: Path, *args: object, **kwargs: object):  # type: ignore[no-untyped-def]
        inspected.append(tool_dir)
        return real(tool_dir, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(discovery, "inspect_tool_dir", counting)
    return inspected


def test_an_unchanged_root_is_answered_without_a_scan(data: Path, scan_count: list[Path]) -> None:
    write_tool(global_root(data), "a")
    write_tool(global_root(data), "b")
    catalog = ToolCatalog(data)
    first = catalog.tools(USER)  # the user has no tools directory: that answer is kept too
    assert len(scan_count) == 2
    for _ in range(3):
        assert catalog.tools(USER) == first and catalog.get("b", USER) is first[1]
    assert len(scan_count) == 2


@pytest.mark.parametrize("change", ["edit_in_place", "new_tool", "new_user_tool", "entry_removed", "entry_js_to_ts",
                                    "manifest_unreadable"])
def test_every_change_a_scan_would_see_ends_the_snapshot(data: Path, scan_count: list[Path], change: str) -> None:
    tool_dir = write_tool(global_root(data), "a", entry="index.js")
    catalog = ToolCatalog(data)
    catalog.tools(USER)
    manifest = tool_dir / "TOOL.md"
    if change == "edit_in_place":  # same inode and size; only the timestamps move
        text = manifest.read_text()
        with manifest.open("r+") as file:
            file.write(text.replace("version: 1", "version: 2"))
    elif change == "new_tool":
        write_tool(global_root(data), "b")
    elif change == "new_user_tool":
        write_tool(user_root(data), "mine")
    elif change == "entry_removed":
        (tool_dir / "index.js").unlink()
    elif change == "entry_js_to_ts":
        (tool_dir / "index.ts").write_text("export async function execute() { return { content: [] }; }\n")
    elif change == "manifest_unreadable":
        manifest.chmod(0)
    before = len(scan_count)
    tools = catalog.tools(USER)
    assert len(scan_count) > before
    expected = {
        "edit_in_place": lambda: tools[0].manifest.version == 2,
        "new_tool": lambda: names(tools) == ["a", "b"],
        "new_user_tool": lambda: names(tools) == ["a", "mine"],
        "entry_removed": lambda: tools == [],
        "entry_js_to_ts": lambda: tools[0].entry.name == "index.ts",
        # Root reads a mode-0 file anyway: then the rescan (asserted above) still lists it.
        "manifest_unreadable": lambda: tools == [] if os.geteuid() != 0 else names(tools) == ["a"],
    }
    assert expected[change]()


def test_a_dangling_entry_link_that_gets_a_target_is_seen(data: Path, scan_count: list[Path]) -> None:
    # The target is two levels away, so no directory the fingerprint stats changes: only the link's own stat does.
    tool_dir = write_tool(global_root(data), "a", entry=None)
    (global_root(data) / "shared" / "lib").mkdir(parents=True)
    (tool_dir / "index.ts").symlink_to("../shared/lib/impl.ts")
    catalog = ToolCatalog(data)
    assert catalog.tools() == []
    (global_root(data) / "shared" / "lib" / "impl.ts").write_text("export async function execute() { return { content: [] }; }\n")
    assert names(catalog.tools()) == ["a"]


def test_a_root_changed_within_the_racy_window_is_scanned_every_time(data: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Timestamps from a coarse clock cannot tell two changes within one tick apart: until
    # the window has passed since the last change, nothing of that root is trusted.
    monkeypatch.setattr(freshness, "RACY_WINDOW_NS", 3600 * 10**9)
    monkeypatch.setattr(freshness, "RACY_WINDOW_FINE_NS", 3600 * 10**9)
    write_tool(global_root(data), "a")
    catalog = ToolCatalog(data)
    catalog.tools()
    inspected: list[Path] = []
    real = discovery.inspect_tool_dir
    monkeypatch.setattr(discovery, "inspect_tool_dir", lambda d, *a, **k: (inspected.append(d), real(d, *a, **k))[1])
    catalog.tools()
    catalog.tools()
    assert inspected == [global_root(data) / "a"] * 2


def key_changed_at(ns: int) -> tuple[int, int, int, int, int, int]:
    return (1, 2, 3, ns, ns, 0o100644)  # dev, ino, size, mtime, ctime, mode


def test_the_racy_window_is_short_for_sub_second_timestamps_only() -> None:
    # Whole-second timestamps (FAT, old ext3, some network filesystems) cannot tell two changes
    # in one second apart; a filesystem that keeps fractions steps by a kernel tick.
    scan_ns = 1_700_000_010 * 10**9
    whole_second = 1_700_000_009 * 10**9  # 1 s before the scan, no fraction
    assert freshness.racy_key(key_changed_at(whole_second), scan_ns)
    assert not freshness.racy_key(key_changed_at(whole_second - 3 * 10**9), scan_ns)
    assert not freshness.racy_key(key_changed_at(whole_second + 1), scan_ns)  # a fraction, 1 s old
    assert freshness.racy_key(key_changed_at(scan_ns - 10_000_000), scan_ns)  # a fraction, one tick old
    assert freshness.racy_key(key_changed_at(scan_ns + 500_000_123), scan_ns)  # from the future: never trusted
    # The ctime decides (the kernel sets it; a tool can set its mtime to a whole second).
    assert freshness.racy_key((1, 2, 3, whole_second - 5 * 10**9, whole_second, 0o100644), scan_ns)


def test_a_root_written_just_now_is_trusted_once_the_short_window_has_passed(
        data: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import asyncio
    import time

    write_tool(user_root(data), "a")
    ctime_ns = (user_root(data) / "a" / "TOOL.md").stat().st_ctime_ns
    assert ctime_ns % 10**9, "this test needs a filesystem with sub-second timestamps (tmpfs, ext4, overlayfs)"
    catalog = ToolCatalog(data)
    scans: list[Path] = []
    real = discovery.ToolCatalog._scan
    monkeypatch.setattr(discovery.ToolCatalog, "_scan", lambda self, root, *a, **k: (scans.append(root),
                                                                                     real(self, root, *a, **k))[1])

    async def main() -> None:
        await catalog.refresh(USER, since=time.monotonic())
        assert catalog._snapshots[user_root(data)].racy  # just written: not trusted yet
        # Until the files are 0.3 s old by the clock the window is measured on: many kernel
        # ticks, and well inside a whole-second window.
        while time.time_ns() < ctime_ns + 300_000_000:
            await asyncio.sleep(0.01)
        with pytest.raises(discovery.ScanNeeded):
            catalog.lookup("a", USER, since=time.monotonic())
        await catalog.refresh(USER, since=time.monotonic())
        scans.clear()
        for _ in range(100):  # with the 2 s window every one of these raised ScanNeeded
            assert catalog.lookup("a", USER, since=time.monotonic()).name == "a"
        assert scans == []

    asyncio.run(main())
    catalog.close()


def test_get_sees_its_own_tool_change_at_once(data: Path, scan_count: list[Path]) -> None:
    tool_dir = write_tool(global_root(data), "a", version=1)
    write_tool(global_root(data), "b")
    catalog = ToolCatalog(data)
    assert catalog.get("a", USER).manifest.version == 1
    write_tool(global_root(data), "a", version=2, description="Longer than before, so the size changes too.")
    assert catalog.get("a", USER).manifest.version == 2
    (tool_dir / "index.ts").unlink()
    assert catalog.get("a", USER) is None
    write_tool(user_root(data), "b", description="Mine.")
    assert catalog.get("b", USER).source == "user"


def test_get_checks_only_the_called_tool_between_full_checks(data: Path, scan_count: list[Path],
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    # Where inotify cannot watch a root, or is not available: the stat checks.
    monkeypatch.setattr(discovery.RootWatcher, "create", lambda files: None)
    write_tool(global_root(data), "a")
    write_tool(global_root(data), "b")
    catalog = ToolCatalog(data)
    catalog.tools(USER)
    stats: list[str] = []
    real = freshness.stat_key
    monkeypatch.setattr(freshness, "stat_key", lambda path: (stats.append(path), real(path))[1])
    assert catalog.get("a", USER) is not None
    # The user's root (missing), the global root, a's TOOL.md and index.ts: nothing of b.
    assert len(stats) == 4 and not any("/b/" in path for path in stats)
    # Another tool renaming itself in place to "a" (the last directory wins) is seen at the next full check.
    manifest = global_root(data) / "b" / "TOOL.md"
    manifest.write_text(manifest.read_text().replace("name: b", "name: a"))
    monkeypatch.setattr(discovery, "_FULL_CHECK_INTERVAL_S", 0.0)
    assert catalog.get("a", USER).dir.name == "b"


# --- tool freshness from inotify: no stat call on a watched root ------------------------------


@pytest.fixture
def stat_calls(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Paths the stat checks look at (none while inotify vouches for a root); no racy window."""
    no_racy_window(monkeypatch)
    stats: list[str] = []
    real = freshness.stat_key
    monkeypatch.setattr(freshness, "stat_key", lambda path: (stats.append(path), real(path))[1])
    return stats


def lookup(catalog: ToolCatalog, name: str) -> Tool | None:
    return catalog.lookup(name, USER, since=time.monotonic())


@pytest.mark.parametrize("change", ["edit_in_place", "replaced_by_rename", "entry_removed", "renamed_in_place",
                                    "new_user_tool", "mode_changed"])
def test_a_watched_tool_is_looked_up_without_stat_calls_and_every_change_is_seen_at_the_next_lookup(
        data: Path, stat_calls: list[str], change: str, monkeypatch: pytest.MonkeyPatch) -> None:
    tool_dir = write_tool(global_root(data), "a")
    write_tool(global_root(data), "b")
    catalog = ToolCatalog(data)
    catalog.tools(USER)  # scanned: the global root and its tools are watched, the missing user root's ancestor too
    stat_calls.clear()
    for _ in range(10):
        assert lookup(catalog, "a").name == "a"
    assert stat_calls == []
    manifest = tool_dir / "TOOL.md"
    if change == "edit_in_place":  # same inode, same size: a stat sees only the timestamps move
        with manifest.open("r+") as file:
            file.write(manifest.read_text().replace("version: 1", "version: 2"))
    elif change == "replaced_by_rename":  # how editors save
        (tool_dir / "TOOL.md.new").write_text(manifest.read_text().replace("version: 1", "version: 3"))
        (tool_dir / "TOOL.md.new").rename(manifest)
    elif change == "entry_removed":
        (tool_dir / "index.ts").unlink()
    elif change == "renamed_in_place":  # another tool takes the name (the last directory wins): the stat
        other = global_root(data) / "b" / "TOOL.md"  # checks decide once an event came, the full one included
        other.write_text(other.read_text().replace("name: b", "name: a"))
        monkeypatch.setattr(discovery, "_FULL_CHECK_INTERVAL_S", 0.0)
    elif change == "new_user_tool":
        write_tool(user_root(data), "a", description="Mine.")
    elif change == "mode_changed":
        (tool_dir / "index.ts").chmod(0o600)
    with pytest.raises(discovery.ScanNeeded):  # no stale answer: the next call scans first
        lookup(catalog, "a")
    expected = {"edit_in_place": lambda t: t.manifest.version == 2, "replaced_by_rename": lambda t: t.manifest.version == 3,
                "entry_removed": lambda t: t is None, "renamed_in_place": lambda t: t.dir.name == "b",
                "new_user_tool": lambda t: t.source == "user", "mode_changed": lambda t: t.name == "a"}
    assert expected[change](catalog.get("a", USER))
    catalog.close()


@pytest.mark.parametrize("link", ["symlink", "hardlink"])
def test_a_tool_whose_files_are_linked_is_stat_checked_since_inotify_misses_edits_through_the_link(
        data: Path, stat_calls: list[str], tmp_path: Path, link: str) -> None:
    tool_dir = write_tool(global_root(data), "a", entry=None)
    target = global_root(data) / "lib.ts" if link == "symlink" else tmp_path / "elsewhere.ts"
    target.write_text("export async function execute() { return { content: [] }; }\n")
    if link == "symlink":
        (tool_dir / "index.ts").symlink_to("../lib.ts")
    else:
        os.link(target, tool_dir / "index.ts")
    catalog = ToolCatalog(data)
    catalog.tools(USER)
    stat_calls.clear()
    assert lookup(catalog, "a").name == "a"
    assert any(path.endswith("/a/index.ts") for path in stat_calls)
    target.write_text("export async function execute() { return { content: [{ type: 'text', text: 'new' }] }; }\n")
    with pytest.raises(discovery.ScanNeeded):  # the edit through the other path is seen all the same
        lookup(catalog, "a")
    catalog.close()


def test_roots_past_the_watch_budget_are_stat_checked(data: Path, stat_calls: list[str],
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(inotify, "MAX_WATCHES", 3)  # the global root and its two tools; none left for the user's
    write_tool(global_root(data), "a")
    write_tool(global_root(data), "b")
    write_tool(user_root(data), "mine")
    catalog = ToolCatalog(data)
    catalog.tools(USER)
    stat_calls.clear()
    assert lookup(catalog, "mine").source == "user"
    assert stat_calls and all(path.startswith(str(user_root(data))) for path in stat_calls)  # the global root is watched
    catalog.close()


def test_a_lookup_during_a_scan_waits_for_it_and_the_next_one_sees_its_result(
        data: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Armed again, a root is clean before its scan has read it: the scan before must not answer then
    (an edit finished before the call would not be seen), nor lookup()'s tools by name built from it."""
    import threading

    tool_dir = write_tool(global_root(data), "a")
    time.sleep(0.1)  # out of the racy window: these scans are trusted
    catalog = ToolCatalog(data)
    catalog.tools(USER)
    assert lookup(catalog, "a").manifest.version == 1
    manifest = tool_dir / "TOOL.md"
    manifest.write_text(manifest.read_text().replace("version: 1", "version: 2"))
    time.sleep(0.1)
    entered, release = threading.Event(), threading.Event()
    real = discovery._parse

    def parse(manifest_path: Path, root: Path):  # type: ignore[no-untyped-def]
        entered.set()
        release.wait(10)
        return real(manifest_path, root)

    monkeypatch.setattr(discovery, "_parse", parse)
    with ThreadPoolExecutor(1) as pool:
        scan = pool.submit(catalog.tools, USER)
        try:
            assert entered.wait(5)
            with pytest.raises(discovery.ScanNeeded):  # the call joins the scan under way
                lookup(catalog, "a")
        finally:
            release.set()
        scan.result(timeout=10)
    assert lookup(catalog, "a").manifest.version == 2
    catalog.close()


def test_a_user_tools_root_made_after_the_scan_is_seen_at_the_next_lookup(data: Path, stat_calls: list[str]) -> None:
    write_tool(global_root(data), "a")
    catalog = ToolCatalog(data)
    catalog.tools(USER)  # the user has no folder yet: the data path is watched for it
    stat_calls.clear()
    assert lookup(catalog, "a").source == "global" and stat_calls == []
    write_tool(user_root(data), "a", description="Mine.")
    with pytest.raises(discovery.ScanNeeded):
        lookup(catalog, "a")
    catalog.tools(USER)
    assert lookup(catalog, "a").source == "user"
    (user_root(data) / "a" / "index.ts").unlink()  # the new root is watched in its turn
    with pytest.raises(discovery.ScanNeeded):
        lookup(catalog, "a")
    catalog.close()


# --- a hostile user tools root ----------------------------------------------------------------


def test_a_user_tools_root_that_is_a_symlink_is_refused_with_the_fix(data: Path, tmp_path: Path) -> None:
    elsewhere = tmp_path / "elsewhere"
    write_tool(elsewhere, "stolen")
    (data / USER).mkdir(parents=True)
    user_root(data).symlink_to(elsewhere)
    tools, skipped = ToolCatalog(data).scan(USER)
    assert tools == []
    assert [(entry.dir, entry.source) for entry in skipped] == [(user_root(data), "user")]
    problem = skipped[0].problems[0]
    assert "symbolic link" in problem.message and f"rm {user_root(data)} && mkdir {user_root(data)}" in problem.fix


def test_a_user_tools_root_linked_to_another_users_tools_is_refused(data: Path) -> None:
    write_tool(user_root(data, "bob@example.com"), "bobs")
    (data / USER).mkdir(parents=True)
    user_root(data).symlink_to(user_root(data, "bob@example.com"))
    assert ToolCatalog(data).tools(USER) == []


def test_a_user_tools_root_that_is_a_file_is_refused(data: Path) -> None:
    (data / USER).mkdir(parents=True)
    user_root(data).write_text("")
    tools, skipped = ToolCatalog(data).scan(USER)
    assert tools == [] and "not a directory" in skipped[0].problems[0].message


def test_a_user_root_swapped_for_a_link_after_the_check_is_still_not_followed(data: Path, tmp_path: Path) -> None:
    # inspect_tool_dir is what runs after the root check: files must resolve within the
    # root's own path, not within wherever a link swapped in meanwhile points.
    elsewhere = tmp_path / "elsewhere"
    write_tool(elsewhere, "stolen")
    (data / USER).mkdir(parents=True)
    user_root(data).symlink_to(elsewhere)
    tool, problems = discovery.inspect_tool_dir(user_root(data) / "stolen", user_root(data), "user")
    assert tool is None and "outside the tools directory" in problems[0].message


# --- bounds on a scan ---------------------------------------------------------------------------


def test_entries_past_the_limit_are_skipped_with_a_problem(data: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(discovery, "MAX_ENTRIES_PER_ROOT", 3)
    for dirname in ("a", "b", "c", "d", "e"):
        write_tool(user_root(data), dirname)
    tools, skipped = ToolCatalog(data).scan(USER)
    assert names(tools) == ["a", "b", "c"]
    assert skipped[0].dir == user_root(data) and "holds 5 entries; only the first 3" in skipped[0].problems[0].message
    assert "d, e are skipped" in skipped[0].problems[0].message


def test_manifests_past_the_root_byte_budget_are_skipped(data: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    write_tool(user_root(data), "a")
    size = (user_root(data) / "a" / "TOOL.md").stat().st_size
    monkeypatch.setattr(discovery, "MAX_ROOT_MANIFEST_BYTES", size * 2)
    for dirname in ("b", "c", "d"):
        write_tool(user_root(data), dirname)
    tools, skipped = ToolCatalog(data).scan(USER)
    assert names(tools) == ["a", "b"]
    assert skipped_dirs(skipped) == ["c", "d"] and "add up to more than" in skipped[0].problems[0].message


def test_a_scan_past_its_time_limit_skips_the_rest_and_tries_again(data: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    no_racy_window(monkeypatch)
    write_tool(user_root(data), "a")
    catalog = ToolCatalog(data)
    monkeypatch.setattr(discovery, "ROOT_SCAN_TIME_LIMIT_S", -1.0)
    tools, skipped = catalog.scan(USER)
    assert tools == [] and "took longer than" in skipped[0].problems[0].message
    monkeypatch.setattr(discovery, "ROOT_SCAN_TIME_LIMIT_S", 5.0)
    assert names(catalog.tools(USER)) == ["a"]  # an incomplete scan is never trusted as it is


def test_a_tools_list_answer_is_bounded_and_says_what_it_left_out(data: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    for dirname in ("a", "b", "c"):
        write_tool(global_root(data), dirname)
    one = ToolCatalog(data).tools()[0].protocol_bytes
    monkeypatch.setattr(discovery, "MAX_LIST_BYTES", one * 2 + 1)
    tools, skipped = ToolCatalog(data).scan()
    assert names(tools) == ["a", "b"]
    assert skipped_dirs(skipped) == ["c"] and "left out of tools/list" in skipped[0].problems[0].message


# --- off the event loop -----------------------------------------------------------------------


def test_lookup_never_scans_and_refresh_scans_in_a_worker(data: Path, parse_count: list[Path],
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    import asyncio
    import threading
    import time

    write_tool(global_root(data), "a")
    catalog = ToolCatalog(data)
    threads: list[str] = []
    real = discovery.inspect_tool_dir

    def recording(*args, **kwargs):  # type: ignore[no-untyped-def]
        threads.append(threading.current_thread().name)
        return real(*args, **kwargs)

    monkeypatch.setattr(discovery, "inspect_tool_dir", recording)

    async def main() -> None:
        arrived = time.monotonic()
        with pytest.raises(discovery.ScanNeeded):
            catalog.lookup("a", USER, since=arrived)
        assert parse_count == []
        await catalog.refresh(USER, since=arrived)
        assert catalog.lookup("a", USER, since=arrived).name == "a"
        assert names(await catalog.tools_async(USER)) == ["a"]

    asyncio.run(main())
    catalog.close()
    assert threads and all(name.startswith("sandboxd-scan") for name in threads), threads


def test_concurrent_listings_of_one_root_share_one_scan(data: Path, scan_count: list[Path]) -> None:
    import asyncio

    write_tool(user_root(data), "a")
    catalog = ToolCatalog(data)

    async def main() -> list[list[Tool]]:
        return await asyncio.gather(*(catalog.tools_async(USER) for _ in range(20)))

    results = asyncio.run(main())
    catalog.close()
    assert all(names(result) == ["a"] for result in results)
    assert scan_count == [user_root(data) / "a"]


def test_a_slow_root_does_not_hold_up_another_users_scan(data: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import threading

    write_tool(user_root(data, "mallory@example.com"), "slow")
    write_tool(user_root(data), "quick")
    release = threading.Event()
    entered = threading.Event()
    real = discovery._parse

    def parse(manifest_path: Path, root: Path):  # type: ignore[no-untyped-def]
        if "mallory" in str(manifest_path):
            entered.set()
            release.wait(10)
        return real(manifest_path, root)

    monkeypatch.setattr(discovery, "_parse", parse)
    catalog = ToolCatalog(data)
    catalog.tools()  # the global root, scanned once before the race
    with ThreadPoolExecutor(2) as pool:
        slow = pool.submit(catalog.tools, "mallory@example.com")
        assert entered.wait(5)
        quick = pool.submit(catalog.tools, USER)
        try:
            assert names(quick.result(timeout=5)) == ["quick"]  # one lock for all roots would wait for mallory
        finally:
            release.set()
        assert names(slow.result(timeout=10)) == ["slow"]


def test_many_listings_of_a_slow_root_take_one_worker_not_all(data: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import asyncio
    import threading

    write_tool(user_root(data, "mallory@example.com"), "slow")
    write_tool(user_root(data), "quick")
    release = threading.Event()
    real = discovery._parse

    def parse(manifest_path: Path, root: Path):  # type: ignore[no-untyped-def]
        if "mallory" in str(manifest_path):
            release.wait(10)
        return real(manifest_path, root)

    monkeypatch.setattr(discovery, "_parse", parse)
    catalog = ToolCatalog(data)
    catalog.tools()

    async def main() -> None:
        slow = [asyncio.ensure_future(catalog.tools_async("mallory@example.com")) for _ in range(10)]
        await asyncio.sleep(0.1)
        try:
            # Ten waiting requests for mallory's root must not fill the worker pool.
            assert names(await asyncio.wait_for(catalog.tools_async(USER), 5)) == ["quick"]
        finally:
            release.set()
        assert all(names(result) == ["slow"] for result in await asyncio.gather(*slow))

    asyncio.run(main())
    catalog.close()


def test_endless_users_without_tools_do_not_grow_the_caches(data: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(discovery, "_MAX_CACHED_ROOTS", 10)
    write_tool(user_root(data), "mine")
    catalog = ToolCatalog(data)
    assert names(catalog.tools(USER)) == ["mine"]
    for index in range(50):
        assert catalog.tools(f"user{index}@example.com") == []
    assert len(catalog._snapshots) <= 11 and len(catalog._root_locks) <= 11
    assert user_root(data) in catalog._snapshots  # a root with tools keeps its scan
