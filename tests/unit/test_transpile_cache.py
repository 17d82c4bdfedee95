"""The transpile cache's host side, and that the shim finds what it writes (node on the host)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from sandboxd.tools import transpile_cache
from sandboxd.tools.discovery import ToolCatalog
from sandboxd.tools.esbuild import NODE_TARGET, Esbuild
from sandboxd.tools.transpile_cache import fill

SHIM = Path(__file__).resolve().parents[2] / "images" / "node" / "shim"
ESBUILD_PACKAGE = SHIM / "node_modules" / "esbuild" / "package.json"
ESBUILD_BINARY = SHIM / "node_modules" / "@esbuild" / "linux-x64" / "bin" / "esbuild"
TOOL_TS = """\
import { greet } from './greet';
export async function execute(_id: string, params: { name: string }) {
  return { content: [{ type: 'text' as const, text: greet(params.name) + ' ' + import.meta.url }] };
}
"""
GREET_TS = "export const greet = (name: string): string => `Hello, ${name}!`;\n"


@pytest.fixture
def esbuild() -> Esbuild:
    assert ESBUILD_BINARY.is_file(), "the shim's node_modules are missing: run `make setup` (npm ci in images/node/shim)"
    return Esbuild(ESBUILD_BINARY, json.loads(ESBUILD_PACKAGE.read_text())["version"])


def tools_root(tmp_path: Path) -> Path:
    root = tmp_path / "tools"
    (root / "hello").mkdir(parents=True)
    (root / "hello" / "index.ts").write_text("\ufeff" + TOOL_TS)  # the shim drops a BOM before hashing
    (root / "hello" / "greet.ts").write_text(GREET_TS)
    return root


def test_the_host_transpiles_for_the_node_the_shim_transpiles_for() -> None:
    """An entry is what the shim would make: one target on both sides (runtime.test.js ties it to the image's Node)."""
    assert f"const NODE_TARGET = '{NODE_TARGET}';" in (SHIM / "src" / "loader.js").read_text()


def run_shim_loader(root: Path, cache: Path) -> dict[str, object]:
    """Load hello through the shim's own loader on the host, with the cache; its stats and answer."""
    script = f"""
const loader = require({json.dumps(str(SHIM / 'src' / 'loader.js'))});
loader.install({{ precompiledDir: {json.dumps(str(cache))}, toolsDirs: {json.dumps(str(root))} }});
const {{ mod }} = loader.load({json.dumps(str(root / 'hello' / 'index.ts'))});
mod.execute('1', {{ name: 'cache' }}).then((r) => console.log(JSON.stringify({{ stats: loader.stats, text: r.content[0].text }})));
"""
    done = subprocess.run(["node", "-e", script], capture_output=True, text=True, timeout=60, check=True)
    return json.loads(done.stdout)


def test_the_shim_loads_what_the_daemon_transpiled_without_starting_esbuild(tmp_path: Path, esbuild: Esbuild) -> None:
    root = tools_root(tmp_path)
    cache = tmp_path / "cache"
    # Files at their host paths here (in a sandbox: /officer/tools/...), so the shim on the host finds them.
    report = fill(root, cache, esbuild, container_root=str(root))
    assert (report.written, report.present, report.skipped) == (2, 0, 0)
    answer = run_shim_loader(root, cache)
    assert answer["text"] == f"Hello, cache! file://{root}/hello/index.ts"
    stats = answer["stats"]
    assert stats["precompiledHits"] == 2 and stats["transpiles"] == 0 and stats["esbuildStarted"] is False, stats


def test_a_source_edited_since_the_fill_is_a_miss_and_transpiled_by_the_shim(tmp_path: Path, esbuild: Esbuild) -> None:
    root = tools_root(tmp_path)
    cache = tmp_path / "cache"
    fill(root, cache, esbuild, container_root=str(root))
    (root / "hello" / "greet.ts").write_text(GREET_TS.replace("Hello", "Howdy"))
    answer = run_shim_loader(root, cache)
    assert answer["text"].startswith("Howdy, cache!")
    assert answer["stats"]["precompiledHits"] == 1 and answer["stats"]["transpiles"] == 1


def test_a_fill_writes_each_entry_once_whole_and_readable(tmp_path: Path, esbuild: Esbuild) -> None:
    root = tools_root(tmp_path)
    cache = tmp_path / "cache"
    old_umask = os.umask(0o077)  # a strict daemon umask must not hide the entries from the sandbox uid
    try:
        fill(root, cache, esbuild, container_root=str(root))
    finally:
        os.umask(old_umask)
    again = fill(root, cache, esbuild, container_root=str(root))
    assert (again.written, again.present) == (0, 2)
    entries = sorted(cache.iterdir())
    assert len(entries) == 2 and all(path.suffix == ".js" and not path.name.startswith(".") for path in entries)
    assert all(path.stat().st_mode & 0o777 == 0o644 for path in entries) and cache.stat().st_mode & 0o777 == 0o755


def test_a_fill_removes_the_entries_no_current_source_needs(tmp_path: Path, esbuild: Esbuild) -> None:
    root = tools_root(tmp_path)
    cache = tmp_path / "cache"
    fill(root, cache, esbuild, container_root=str(root))
    before = {path.name for path in cache.iterdir()}
    (root / "hello" / "greet.ts").write_text(GREET_TS.replace("Hello", "Howdy"))  # edited: a new key
    (cache / ".left.js.4242.1").write_text("half written by a daemon that was killed")
    report = fill(root, cache, esbuild, container_root=str(root))
    assert (report.written, report.present, report.removed) == (1, 1, 2), report
    after = {path.name for path in cache.iterdir()}
    assert len(after) == 2 and len(after & before) == 1  # index.ts's entry kept, greet.ts's replaced
    shutil.rmtree(root / "hello")
    assert fill(root, cache, esbuild, container_root=str(root)).removed == 2 and not list(cache.iterdir())


def test_the_caches_of_other_esbuild_versions_are_removed(tmp_path: Path) -> None:
    current = transpile_cache.cache_dir(tmp_path, "0.28.0")
    for name in ("0.28.0", "0.27.3", "0.25.0-beta.1"):
        (current.parent / name).mkdir(parents=True)
        (current.parent / name / "x.js").write_text("1")
    (current.parent / "notes").mkdir()  # not a version: not ours to judge
    assert sorted(transpile_cache.remove_other_versions(tmp_path, "0.28.0")) == ["0.25.0-beta.1", "0.27.3"]
    assert sorted(path.name for path in current.parent.iterdir()) == ["0.28.0", "notes"]
    assert (current / "x.js").exists()
    assert transpile_cache.remove_other_versions(tmp_path / "nothing", "0.28.0") == []


def test_what_the_shim_would_not_find_or_must_report_itself_is_not_cached(tmp_path: Path, esbuild: Esbuild) -> None:
    root = tools_root(tmp_path)
    (root / "hello" / "node_modules" / "dep").mkdir(parents=True)
    (root / "hello" / "node_modules" / "dep" / "index.js").write_text("module.exports = 1;\n")
    (root / "hello" / "linked.ts").symlink_to(root / "hello" / "greet.ts")
    (root / "odd name").mkdir()
    (root / "odd name" / "index.ts").write_text(GREET_TS)  # a space: import.meta.url would differ in spelling
    (root / "hello" / "warns.ts").write_text("export const o = { a: 1, a: 2 };\n")  # a duplicate key
    (root / "hello" / "broken.ts").write_text("export const = ;\n")  # the shim's esbuild gives the error
    report = fill(root, tmp_path / "cache", esbuild)
    assert report.written == 2  # index.ts and greet.ts of hello
    assert report.skipped == 3  # "odd name", warns.ts (esbuild warns: the shim logs that), broken.ts


def test_global_tools_that_change_ask_for_a_refill_and_user_tools_do_not(tmp_path: Path) -> None:
    data = tmp_path / "data"
    shutil.copytree(tools_root(tmp_path), data / "tools")
    asked: list[int] = []
    catalog = ToolCatalog(data, on_global_change=lambda: asked.append(1))
    catalog.tools("a@example.com")
    assert len(asked) == 1  # the first scan
    (data / "a@example.com" / "tools" / "mine").mkdir(parents=True)
    (data / "a@example.com" / "tools" / "mine" / "TOOL.md").write_text("---\nname: mine\n---\n")
    catalog.tools("a@example.com")
    assert len(asked) == 1
    (data / "tools" / "new").mkdir()
    catalog.tools("a@example.com")
    assert len(asked) == 2


def test_the_key_names_one_exact_source() -> None:
    key = transpile_cache.key
    base = key("0.28.2", "ts", "/officer/tools/a/index.ts", "x")
    assert len({base, key("0.28.3", "ts", "/officer/tools/a/index.ts", "x"), key("0.28.2", "tsx", "/officer/tools/a/index.ts", "x"),
                key("0.28.2", "ts", "/officer/tools/b/index.ts", "x"), key("0.28.2", "ts", "/officer/tools/a/index.ts", "y")}) == 5
