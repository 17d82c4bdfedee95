"""`sandboxd run` without Docker: the watcher, backend choice, mounts, and the process backend for real.

The session tests start the shim as a local `node` process (the process backend),
so they need Node.js and the shim's dependencies (`make shim-deps`), not Docker.
"""

from __future__ import annotations

import asyncio
import json
import shutil
from pathlib import Path
from typing import Any, Awaitable, TypeVar

import pytest

from sandboxd.cli.main import main
from sandboxd.config import Config, SandboxConfig, load_config
from sandboxd.dev.session import (
    DEV_USER,
    KILL_MESSAGE,
    DevSession,
    choose_backend,
    dev_spec,
    requested_backend,
)
from sandboxd.dev.watch import changed_files, snapshot, wait_for_change
from sandboxd.errors import BackendUnavailable
from sandboxd.sandbox.process_backend import SHIM_MAIN, ProcessBackend, _ready_problem
from sandboxd.sandbox.shim import SHIM_PROTOCOL
from sandboxd.tools.discovery import Tool, inspect_tool_dir

T = TypeVar("T")
NO_DOCKER = "unix:///nonexistent/docker.sock"


def run(coro: Awaitable[T]) -> T:
    return asyncio.run(coro)  # type: ignore[arg-type]


pytestmark = pytest.mark.usefixtures("isolated_config")

def write_tool(root: Path, name: str, source: str, inputs: str = "") -> Path:
    tool = root / name
    tool.mkdir(parents=True, exist_ok=True)
    (tool / "TOOL.md").write_text(f"---\nname: {name}\ndescription: Test tool {name}.\nversion: 1\n"
                                  + (f"inputs:\n{inputs}" if inputs else "") + f"---\n# {name}\n")
    (tool / "index.ts").write_text(source)
    return tool


def user_tool(tool_dir: Path) -> Tool:
    tool, problems = inspect_tool_dir(tool_dir, tool_dir.parent, "user")
    assert tool is not None, problems
    return tool


# --- the watcher -------------------------------------------------------------------------------

def test_snapshot_skips_hidden_files_and_node_modules(tmp_path: Path) -> None:
    tool = tmp_path / "tool"
    for name in ("index.ts", "bin/helper.py", ".index.ts.swp", ".git/HEAD", "node_modules/x/index.js"):
        (tool / name).parent.mkdir(parents=True, exist_ok=True)
        (tool / name).write_text("x")
    assert sorted(snapshot(tool)) == ["bin/helper.py", "index.ts"]


def test_changed_files_names_added_removed_and_modified() -> None:
    before = {"a": (1, 1, 1), "b": (1, 1, 2), "c": (1, 1, 3)}
    after = {"a": (1, 1, 1), "b": (2, 1, 2), "d": (1, 1, 4)}
    assert changed_files(before, after) == ["b", "c", "d"]


def test_wait_for_change_sees_an_edit_once_it_has_settled(tmp_path: Path) -> None:
    tool = tmp_path / "tool"
    tool.mkdir()
    (tool / "index.ts").write_text("v1")

    async def scenario() -> Any:
        before = snapshot(tool)
        stop = asyncio.Event()
        waiting = asyncio.ensure_future(wait_for_change(tool, before, stop, interval=0.02))
        await asyncio.sleep(0.1)
        assert not waiting.done()
        (tool / "index.ts").write_text("v2 longer")
        (tool / "TOOL.md").write_text("new")
        after = await asyncio.wait_for(waiting, 5)
        return changed_files(before, after)

    assert run(scenario()) == ["TOOL.md", "index.ts"]


def test_wait_for_change_returns_none_when_stopped(tmp_path: Path) -> None:
    async def scenario() -> Any:
        stop = asyncio.Event()
        waiting = asyncio.ensure_future(wait_for_change(tmp_path, snapshot(tmp_path), stop, interval=0.02))
        await asyncio.sleep(0.05)
        stop.set()
        return await asyncio.wait_for(waiting, 5)

    assert run(scenario()) is None


# --- choosing the backend ----------------------------------------------------------------------

def test_requested_backend_flag_then_config_then_docker() -> None:
    assert requested_backend("docker", load_config(environ={"SANDBOXD_BACKEND": "process"})) == "docker"
    assert requested_backend(None, load_config(environ={"SANDBOXD_BACKEND": "process"})) == "process"
    assert requested_backend(None, load_config(environ={})) == "docker"
    with pytest.raises(BackendUnavailable, match="fake"):
        requested_backend(None, load_config(environ={"SANDBOXD_BACKEND": "fake"}))


def test_docker_unreachable_is_an_error_with_the_fix_never_a_fallback() -> None:
    config = Config(sandbox=SandboxConfig(docker_host=NO_DOCKER))
    with pytest.raises(BackendUnavailable, match="not reachable; start Docker and run `make image`, or pass "
                                                 "--backend process to run the tool UNSANDBOXED"):
        choose_backend("docker", config)


def test_run_without_docker_stops_and_never_runs_the_tool_unsandboxed(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    tool = write_tool(tmp_path, "probe", SESSION_TOOL, SESSION_INPUTS)
    monkeypatch.setenv("SANDBOXD_SANDBOX_DOCKER_HOST", NO_DOCKER)
    code = main(["run", str(tool), "--arg", "mode=ok", "--data-path", str(tmp_path / "data")])
    out, err = capsys.readouterr()
    assert code == 2 and out == ""
    assert "the Docker engine is not reachable" in err and "pass --backend process" in err
    assert "UNSANDBOXED (" not in err  # no banner: nothing ran


def test_process_requested() -> None:
    choice = choose_backend("process", Config())
    assert choice.backend.name == "process" and choice.unsandboxed


# --- mounts ------------------------------------------------------------------------------------

def test_spec_mounts_only_the_tool_folder_over_a_scratch_tools_root(tmp_path: Path) -> None:
    config = Config(data_path=tmp_path / "data")
    tool_dir = write_tool(tmp_path / "work", "weather", "")
    spec = dev_spec(config, tool_dir, tmp_path / "scratch", None, mount_tool=True)
    assert (spec.user, spec.user_dir, spec.user_tools_dir, spec.email_db) == (
        DEV_USER, tmp_path / "scratch", tmp_path / "scratch" / "tools", None)
    assert spec.tools_dir == tmp_path / "data" / "tools"
    assert spec.read_only_mounts == ((tool_dir, "/officer/user/tools/weather"),)
    assert (tmp_path / "scratch" / "tools" / "weather").is_dir()  # the mount point Docker cannot create


def test_spec_with_a_user_uses_their_data_but_not_their_tools(tmp_path: Path) -> None:
    config = Config(data_path=tmp_path / "data")
    tool_dir = write_tool(tmp_path / "work", "weather", "")
    spec = dev_spec(config, tool_dir, tmp_path / "scratch", "a@example.com", mount_tool=False)
    assert spec.user == "a@example.com" and spec.user_dir == tmp_path / "data" / "a@example.com"
    assert spec.user_tools_dir == tmp_path / "scratch" / "tools" and spec.read_only_mounts == ()
    assert spec.email_db == tmp_path / "data" / "email" / "a@example.com" / "emails.db"
    assert spec.root == tmp_path / "data"
    assert not (tmp_path / "scratch" / "tools" / "weather").exists()


# --- the process backend ----------------------------------------------------------------------

def test_the_process_backend_refuses_a_shim_without_its_dependencies(tmp_path: Path) -> None:
    shim = tmp_path / "shim" / "src" / "main.js"
    shim.parent.mkdir(parents=True)
    shutil.copy(SHIM_MAIN, shim)
    backend = ProcessBackend(max_line_bytes=1 << 20, shim=shim)
    config = Config(data_path=tmp_path / "data")
    spec = dev_spec(config, write_tool(tmp_path, "t", ""), tmp_path / "scratch", None, mount_tool=False)
    with pytest.raises(BackendUnavailable, match="make shim-deps"):
        run(backend.start(spec))


def test_the_process_backend_refuses_an_old_node_or_another_protocol() -> None:
    assert _ready_problem({"protocol": SHIM_PROTOCOL, "node": "v20.11.0"}, "node") is None
    assert "Node.js 20 or newer" in (_ready_problem({"protocol": SHIM_PROTOCOL, "node": "v18.19.1"}, "/usr/bin/node") or "")
    other = SHIM_PROTOCOL + 1
    assert f"protocol {other}" in (_ready_problem({"protocol": other, "node": "v20.1.0"}, "node") or "")


SESSION_TOOL = """
type Block = { type: string; text: string };
export async function execute(_id: string, params: { mode: string }, signal?: AbortSignal,
                              onUpdate?: (p: { content: Block[] }) => void) {
  console.error(`debug: mode ${params.mode}`);
  onUpdate?.({ content: [{ type: 'text', text: 'working' }] });
  if (params.mode === 'wait') {
    await new Promise((resolve) => signal?.addEventListener('abort', resolve));
    return { content: [{ type: 'text', text: `aborted: ${(signal?.reason as Error).message}` }] };
  }
  if (params.mode === 'stubborn') await new Promise((resolve) => setTimeout(resolve, 60_000));
  if (params.mode === 'exit') process.exit(3);
  return { content: [{ type: 'text', text: `VERSION ${process.env.OFFICER_USER_ROOT === process.env.HOME}` }] };
}
"""
SESSION_INPUTS = "  mode:\n    type: string\n    description: What to do.\n"


class Harness:
    """A DevSession on the process backend, recording what the developer would see."""

    def __init__(self, tmp_path: Path, *, keep_warm: bool = False) -> None:
        self.tool_dir = write_tool(tmp_path / "work", "probe", SESSION_TOOL, SESSION_INPUTS)
        config = Config(data_path=tmp_path / "data")
        choice = choose_backend("process", config)
        spec = dev_spec(config, self.tool_dir, tmp_path / "scratch", None, mount_tool=False)
        self.lines: list[str] = []
        self.progress: list[Any] = []
        self.session = DevSession(config, choice, spec, keep_warm=keep_warm, on_tool_output=self.lines.append)

    async def call(self, mode: str, timeout_s: float = 20) -> dict[str, Any]:
        return await self.session.call(user_tool(self.tool_dir), {"mode": mode}, timeout_s, self.progress.extend)


def test_session_runs_a_tool_streaming_progress_and_console_output(tmp_path: Path) -> None:
    async def scenario() -> tuple[Harness, dict[str, Any]]:
        harness = Harness(tmp_path)
        try:
            return harness, await harness.call("ok")
        finally:
            await harness.session.close()

    harness, outcome = run(scenario())
    assert (outcome["status"], outcome["isError"], outcome["content"]) == (
        "ok", False, [{"type": "text", "text": "VERSION true"}])
    assert harness.progress == [{"type": "text", "text": "working"}]
    assert "[run_1] debug: mode ok" in harness.lines


def test_interrupt_fires_the_abort_signal_and_keeps_the_tools_answer(tmp_path: Path) -> None:
    async def scenario() -> dict[str, Any]:
        harness = Harness(tmp_path)
        try:
            call = asyncio.ensure_future(harness.call("wait"))
            while not harness.progress:  # the tool is waiting on its signal
                await asyncio.sleep(0.02)
            assert harness.session.interrupt() == "cancel"
            return await asyncio.wait_for(call, 10)
        finally:
            await harness.session.close()

    outcome = run(scenario())
    assert (outcome["status"], outcome["isError"]) == ("cancelled", True)
    assert outcome["content"] == [{"type": "text", "text": "aborted: cancelled with Ctrl-C"}]


def test_a_second_interrupt_kills_a_tool_that_ignores_its_signal(tmp_path: Path) -> None:
    async def scenario() -> tuple[dict[str, Any], Any]:
        harness = Harness(tmp_path)
        try:
            assert harness.session.interrupt() is None  # nothing runs yet
            call = asyncio.ensure_future(harness.call("stubborn"))
            while not harness.progress:
                await asyncio.sleep(0.02)
            assert harness.session.interrupt() == "cancel"
            assert harness.session.interrupt() == "kill"
            return await asyncio.wait_for(call, 10), harness.session.pool.stats
        finally:
            await harness.session.close()

    outcome, stats = run(scenario())
    assert (outcome["status"], outcome["content"]) == ("cancelled", [{"type": "text", "text": KILL_MESSAGE}])
    assert stats["destroyed"] >= 1


def test_timeout_and_crash_are_reported_like_the_daemon_does(tmp_path: Path) -> None:
    async def scenario() -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
        harness = Harness(tmp_path, keep_warm=True)
        try:
            return await harness.call("stubborn", timeout_s=0.5), await harness.call("exit"), await harness.call("ok")
        finally:
            await harness.session.close()

    timed_out, crashed, after = run(scenario())
    assert timed_out["status"] == "timeout" and "did not finish within 0.5 s" in timed_out["content"][0]["text"]
    assert crashed["status"] == "crashed" and "exited with code 3" in crashed["content"][0]["text"]
    assert after["status"] == "ok"  # a fresh sandbox replaced the broken ones


def test_a_warm_session_reloads_an_edited_tool_without_a_new_sandbox(tmp_path: Path) -> None:
    async def scenario() -> tuple[list[str], dict[str, int]]:
        harness = Harness(tmp_path, keep_warm=True)
        try:
            first = await harness.call("ok")
            entry = harness.tool_dir / "index.ts"
            entry.write_text(entry.read_text().replace("VERSION", "EDITED"))
            second = await harness.call("ok")
            return [first["content"][0]["text"], second["content"][0]["text"]], harness.session.pool.stats
        finally:
            await harness.session.close()

    texts, stats = run(scenario())
    assert texts == ["VERSION true", "EDITED true"] and stats["started"] == 1


# --- the command, in-process -------------------------------------------------------------------

def test_run_prints_the_result_and_says_unsandboxed(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    tool = write_tool(tmp_path, "probe", SESSION_TOOL, SESSION_INPUTS)
    code = main(["run", str(tool), "--arg", "mode=ok", "--backend", "process", "--data-path", str(tmp_path / "data")])
    out, err = capsys.readouterr()
    assert (code, out) == (0, "VERSION true\n")
    assert err.startswith("sandboxd: UNSANDBOXED (the process backend was asked for)")
    assert "… working\n" in err and "[run_1] debug: mode ok\n" in err


def test_run_raw_labels_the_backend(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                    monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SANDBOXD_BACKEND", "process")
    tool = write_tool(tmp_path, "probe", SESSION_TOOL, SESSION_INPUTS)
    code = main(["run", str(tool / "index.ts"), "--json", '{"mode": "ok"}', "--raw",
                 "--data-path", str(tmp_path / "data")])
    raw = json.loads(capsys.readouterr().out)
    assert code == 0 and (raw["backend"], raw["unsandboxed"], raw["status"]) == ("process", True, "ok")


@pytest.mark.parametrize(("argv", "code", "message"), [
    (["--arg", "nope=1"], 2, '"mode" is required'),
    (["--arg", "mode"], 2, "must look like KEY=VALUE"),
    (["--arg", "mode=ok", "--timeout", "0"], 2, "--timeout must be a positive number"),
])
def test_run_usage_errors_exit_2_before_anything_starts(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                        argv: list[str], code: int, message: str) -> None:
    tool = write_tool(tmp_path, "probe", SESSION_TOOL, SESSION_INPUTS)
    assert main(["run", str(tool), "--backend", "process", *argv]) == code
    assert message in capsys.readouterr().err


def test_run_refuses_what_is_not_a_tool(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["run", str(tmp_path / "missing")]) == 2
    assert "does not exist" in capsys.readouterr().err
    assert main(["run", str(tmp_path)]) == 2
    assert "is not a tool folder" in capsys.readouterr().err


def test_run_stops_on_manifest_errors_and_shows_every_finding(tmp_path: Path,
                                                              capsys: pytest.CaptureFixture[str]) -> None:
    tool = tmp_path / "broken"
    tool.mkdir()
    (tool / "TOOL.md").write_text("---\nname: Broken\nversion: 1\n---\n")
    (tool / "index.ts").write_text("export class Broken {}\n")
    assert main(["run", str(tool), "--backend", "process"]) == 1
    err = capsys.readouterr().err
    assert "description is required" in err and "class-pattern" in err
    assert "not running broken: fix the errors above" in err
