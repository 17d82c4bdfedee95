"""The transpile cache: the global tools transpiled on the host, mounted read-only into every sandbox.

A sandbox started once the cache is filled serves a global TypeScript tool without
starting esbuild (the cold path's largest cost, and a process in every idle sandbox);
a user's own tool still works (esbuild starts on the miss); and no sandbox can change
what the other sandboxes load from the cache.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

from tests.e2e.conftest import write_tool
from tests.e2e.hostile_harness import HOSTILE_TOOLS, text_of, wait_until

# Reports whether any process of its sandbox is esbuild (the shim's service is a child of node).
PROBE_TS = """\
import * as fs from "node:fs";

export async function execute() {
  const commands: string[] = [];
  for (const pid of fs.readdirSync("/proc").filter((name) => /^[0-9]+$/.test(name))) {
    try { commands.push(fs.readFileSync(`/proc/${pid}/cmdline`, "utf8").split("\\0").join(" ")); } catch { /* gone */ }
  }
  const esbuild = commands.some((command) => command.includes("esbuild"));
  const text: string = `probe ok; esbuild running: ${esbuild}`;
  return { content: [{ type: "text" as const, text }], details: { esbuild, commands } };
}
"""
# The same probe as a user's tool, which the cache never holds.
USER_TS = PROBE_TS.replace("probe ok", "user tool ok")


def started_with_cache(make_daemon: Any) -> Any:
    daemon = make_daemon(start=False)
    write_tool(daemon.data / "tools", "cache_probe", PROBE_TS)
    daemon.start()
    wait_until(lambda: daemon.events("transpile_cache_filled"), 30, "the transpile cache's first fill")
    return daemon


def test_a_sandbox_serves_global_tools_without_esbuild_and_user_tools_with_it(make_daemon: Any) -> None:
    daemon = started_with_cache(make_daemon)
    user = "cold@example.com"
    write_tool(daemon.user_dir(user) / "tools", "mine", USER_TS)
    with daemon.client() as client:
        probe = client.call_tool(user, "cache_probe", {})
        assert text_of(probe).startswith("probe ok"), probe
        assert probe["details"]["esbuild"] is False, probe["details"]["commands"]
        # A user's tool is never in the cache: its sandbox starts esbuild on the miss, and it works.
        mine = client.call_tool(user, "mine", {})
    assert text_of(mine).startswith("user tool ok") and mine["details"]["esbuild"] is True, mine
    [filled] = daemon.events("transpile_cache_filled")[:1]
    assert filled["written"] >= 1 and filled["dir"].startswith(str(daemon.data / ".cache" / "transpile"))


def test_a_hostile_tool_cannot_change_what_other_sandboxes_load_from_the_cache(make_daemon: Any) -> None:
    daemon = started_with_cache(make_daemon)
    attacker, victim = "mallory@example.com", "victim@example.com"
    shutil.copytree(HOSTILE_TOOLS / "cache_poisoner", daemon.user_dir(attacker) / "tools" / "cache_poisoner")
    cache = Path(daemon.events("transpile_cache_filled")[0]["dir"])
    before = {path.name: path.read_bytes() for path in cache.iterdir()}
    with daemon.client() as client:
        report = client.call_tool(attacker, "cache_poisoner", {"target": "cache_probe"})["details"]
        # It aimed at the real entry: the key it computed names a file in the mounted cache.
        assert report.pop("entry present") == "true", report
        assert len(report) == 7
        # The mount is read-only, and the files are the daemon's, readable only (either may answer first).
        for attempt, outcome in report.items():
            assert outcome in ("EROFS", "EACCES"), f"{attempt}: {outcome} ({json.dumps(report)})"
        # A fresh sandbox of another user loads the real code, from the untouched cache.
        probe = client.call_tool(victim, "cache_probe", {})
    assert text_of(probe).startswith("probe ok") and probe["details"]["esbuild"] is False, probe
    assert {path.name: path.read_bytes() for path in cache.iterdir()} == before


def test_a_global_tool_edited_while_the_daemon_runs_is_transpiled_again(make_daemon: Any) -> None:
    daemon = started_with_cache(make_daemon)
    source = daemon.data / "tools" / "cache_probe" / "index.ts"
    source.write_text(source.read_text().replace("probe ok", "probe v2 ok"))
    with daemon.client() as client:
        client.request("tools/list", {"user": "lister@example.com"})  # the scan that sees the edit asks for a refill
        wait_until(lambda: len(daemon.events("transpile_cache_filled")) >= 2, 30, "the refill after the edit")
        probe = client.call_tool("fresh@example.com", "cache_probe", {})
    assert text_of(probe).startswith("probe v2 ok") and probe["details"]["esbuild"] is False, probe
