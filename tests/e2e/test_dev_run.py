"""The developer loop as a newcomer types it: `sandboxd new`, `validate`, `run` (Docker and process), Ctrl-C,
--watch; and a daemon on the process backend."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, Iterator

import pytest

from tests.e2e.conftest import REPO, write_tool

DEV_LABEL = "org.sandboxd.instance=sandboxd-run"


@pytest.fixture
def env(tmp_path: Path) -> dict[str, str]:
    base = {k: v for k, v in os.environ.items() if not k.startswith("SANDBOXD_")}
    (tmp_path / "empty.yaml").write_text("")
    return {
        **base,
        "SANDBOXD_CONFIG": str(tmp_path / "empty.yaml"),
        "SANDBOXD_DATA_PATH": str(tmp_path / "data"),
        "SANDBOXD_SANDBOX_NETWORK": "none",  # test sandboxes never get a network
        "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), base.get("PYTHONPATH")])),
    }


@pytest.fixture(autouse=True)
def no_leftover_containers(docker_api: Any) -> Iterator[None]:
    yield
    leftovers = docker_api.api.containers(all=True, filters={"label": DEV_LABEL})
    for container in leftovers:
        docker_api.api.remove_container(container["Id"], force=True)
    assert not leftovers, "sandboxd run left containers behind"


def sandboxd(*argv: str, cwd: Path, env: dict[str, str], timeout: float = 90) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "sandboxd", *argv], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=timeout, check=False)


class Running:
    """A `sandboxd run` in the background whose output is read as it comes."""

    def __init__(self, argv: list[str], cwd: Path, env: dict[str, str]) -> None:
        self.proc = subprocess.Popen([sys.executable, "-m", "sandboxd", *argv], cwd=cwd, env=env, text=True,
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        self.out: list[str] = []
        self.err: list[str] = []
        for stream, sink in ((self.proc.stdout, self.out), (self.proc.stderr, self.err)):
            threading.Thread(target=lambda s=stream, k=sink: k.extend(iter(s.readline, "")), daemon=True).start()

    def wait_for(self, sink: list[str], text: str, count: int = 1, timeout: float = 60) -> None:
        deadline = time.monotonic() + timeout
        while sum(text in line for line in list(sink)) < count:
            if time.monotonic() > deadline or self.proc.poll() is not None and not self._draining(sink, text, count):
                raise AssertionError(f"no {text!r} (x{count}) in:\n{''.join(self.out)}\n--- stderr\n{''.join(self.err)}")
            time.sleep(0.05)

    def _draining(self, sink: list[str], text: str, count: int) -> bool:
        time.sleep(0.2)  # the process ended: let the readers catch up once
        return sum(text in line for line in list(sink)) >= count

    def interrupt(self) -> None:
        self.proc.send_signal(signal.SIGINT)

    def finish(self, timeout: float = 60) -> int:
        code = self.proc.wait(timeout)
        time.sleep(0.1)
        return code


@pytest.mark.parametrize("backend", ["docker", "process"])
def test_new_validate_run(tmp_path: Path, env: dict[str, str], backend: str) -> None:
    """The issue's "done when": `sandboxd new weather && sandboxd validate weather && sandboxd run weather --arg city=Paris`."""
    if backend == "process":
        env = {**env, "SANDBOXD_BACKEND": "process"}  # how docs/tool-development.md says to force it
    new = sandboxd("new", "weather", cwd=tmp_path, env=env)
    assert new.returncode == 0, new.stderr
    validate = sandboxd("validate", "weather", cwd=tmp_path, env=env)
    assert (validate.returncode, validate.stdout) == (0, "0 errors, 0 warnings\n")
    ran = sandboxd("run", "weather", "--arg", "city=Paris", cwd=tmp_path, env=env)
    assert (ran.returncode, ran.stdout) == (0, 'Weather received city "Paris".\n'), ran.stderr
    assert "… Looking up Paris..." in ran.stderr
    if backend == "docker":
        assert "running weather in a Docker sandbox" in ran.stderr and "UNSANDBOXED" not in ran.stderr
    else:
        assert ran.stderr.startswith("sandboxd: UNSANDBOXED")


def test_new_then_run_works_the_first_time_with_no_arguments(tmp_path: Path, env: dict[str, str]) -> None:
    """Issue 14: `sandboxd new weather` then `sandboxd run weather`, nothing else, on the default (Docker) backend."""
    new = sandboxd("new", "weather", cwd=tmp_path, env=env)
    assert new.returncode == 0 and "next: sandboxd run weather " in new.stdout, new.stderr
    ran = sandboxd("run", "weather", cwd=tmp_path, env=env)
    assert (ran.returncode, ran.stdout) == (0, 'Weather received city "Paris".\n'), ran.stderr
    assert "running weather in a Docker sandbox" in ran.stderr and "UNSANDBOXED" not in ran.stderr
    next_line = ran.stderr.strip().splitlines()[-1]
    assert next_line.startswith("sandboxd: next: try other inputs with `sandboxd run weather --arg city=VALUE`")
    assert "--watch" in next_line and "sandboxd validate weather" in next_line
    assert f"{tmp_path / 'data'}/<user>/tools/" in next_line


PROBE = """
import { readdirSync, writeFileSync } from 'node:fs';

function attempt(fn: () => void): string {
  try { fn(); return 'ok'; } catch (e) { return (e as NodeJS.ErrnoException).code ?? String(e); }
}

export async function execute(_id: string, params: { file: string }) {
  const facts = {
    uid: process.getuid?.(),
    entry: __filename,
    userTools: readdirSync('/officer/user/tools'),
    writeData: attempt(() => writeFileSync(`/officer/user/${params.file}`, 'written by the tool')),
    writeOwnFolder: attempt(() => writeFileSync(`${__dirname}/x`, 'x')),
    seeSibling: attempt(() => readdirSync(`${__dirname}/../secret`)),
    home: process.env.HOME,
  };
  return { content: [{ type: 'text', text: JSON.stringify(facts) }] };
}
"""


def test_docker_run_mounts_only_the_tool_read_only(tmp_path: Path, env: dict[str, str]) -> None:
    work = tmp_path / "work"
    write_tool(work, "probe", PROBE, inputs="  file:\n    type: string\n    description: A file name.\n")
    (work / "secret").mkdir()
    (work / "secret" / "key").write_text("not for the tool")
    ran = sandboxd("run", "probe", "--arg", "file=out.txt", "--backend", "docker", cwd=work, env=env)
    assert ran.returncode == 0, ran.stderr
    facts = json.loads(ran.stdout)
    assert facts["entry"] == "/officer/user/tools/probe/index.ts" and facts["userTools"] == ["probe"]
    assert (facts["writeData"], facts["writeOwnFolder"], facts["seeSibling"]) == ("ok", "EROFS", "ENOENT")
    assert facts["home"] == "/officer/user" and facts["uid"] != 0

    # With --user, /officer/user is that user's data directory.
    ran = sandboxd("run", "probe", "--arg", "file=mine.txt", "--user", "a@example.com", "--backend", "docker",
                   cwd=work, env=env)
    assert ran.returncode == 0, ran.stderr
    assert (tmp_path / "data" / "a@example.com" / "mine.txt").read_text() == "written by the tool"


WAITER = """
export async function execute(_id: string, _p: {}, signal?: AbortSignal) {
  console.error('waiting for the signal');
  await new Promise((resolve) => signal?.addEventListener('abort', resolve));
  return { content: [{ type: 'text', text: `stopped: ${(signal?.reason as Error).message}` }] };
}
"""


@pytest.mark.parametrize("backend", ["docker", "process"])
def test_ctrl_c_fires_the_abort_signal_and_shows_the_result(tmp_path: Path, env: dict[str, str], backend: str) -> None:
    write_tool(tmp_path, "waiter", WAITER)
    run = Running(["run", "waiter", "--backend", backend], tmp_path, env)
    run.wait_for(run.err, "[run_1] waiting for the signal")
    run.interrupt()
    assert run.finish() == 1
    assert run.out == ["stopped: cancelled with Ctrl-C\n"]
    assert any("the tool's AbortSignal fired" in line for line in run.err)
    assert any("ended with status cancelled" in line for line in run.err)


def test_watch_reruns_on_save_in_the_same_sandbox(tmp_path: Path, env: dict[str, str]) -> None:
    tool = write_tool(tmp_path, "echo", "export async function execute() {\n"
                                        "  return { content: [{ type: 'text', text: 'first' }] };\n}\n")
    run = Running(["run", "echo", "--watch", "--backend", "docker"], tmp_path, env)
    try:
        run.wait_for(run.out, "first")
        run.wait_for(run.err, "watching echo for changes")
        (tool / "index.ts").write_text((tool / "index.ts").read_text().replace("first", "second"))
        run.wait_for(run.out, "second")
        # A broken manifest is reported, and the next fix runs again.
        (tool / "TOOL.md").write_text("---\nname: echo\nversion: 1\n---\n")
        run.wait_for(run.err, "description is required")
        write_tool(tmp_path, "echo", (tool / "index.ts").read_text().replace("second", "third"))
        run.wait_for(run.out, "third")
    finally:
        run.interrupt()
        code = run.finish()
    assert code == 130
    assert run.out == ["first\n", "second\n", "third\n"]
    err = "".join(run.err)
    assert "──── echo · run 2 · " in err and "index.ts changed ────" in err
    assert "changed on disk: reloading" in err  # the shim reloaded it: the sandbox stayed warm


def test_a_daemon_on_the_process_backend_says_it_is_unsandboxed(make_daemon: Any) -> None:
    daemon = make_daemon(config="backend: process\nallow_unsafe: [unsandboxed]\npool:\n  min_idle: 0\n")
    with daemon.client() as client:
        status = client.request("sandbox/status")
        steps: list[Any] = []
        outcome = client.request("tools/call", {"user": "a@example.com", "name": "progress", "arguments": {"steps": 2}},
                                 on_progress=steps.append)
    assert (status["backend"], status["unsandboxed"]) == ("process", True)
    assert outcome["status"] == "ok" and outcome["content"] == [{"type": "text", "text": "did 2 steps"}]
    assert len(steps) == 2
    assert "UNSANDBOXED" in daemon.log()


def test_tools_list_in_a_second_terminal_sees_what_the_daemon_serves(make_daemon: Any, tmp_path: Path,
                                                                    env: dict[str, str]) -> None:
    """Issue 14: after `make serve`, `tools list` elsewhere read another data path and said there were no tools.
    It now asks the daemon at the configured socket, and reads the disk (saying so) only when none answers."""
    daemon = make_daemon(config="pool:\n  min_idle: 0\n")
    user = "dev@example.com"
    write_tool(daemon.user_dir(user) / "tools", "mine", "export async function execute() { return ok(''); }")
    second_terminal = {**env, "SANDBOXD_SOCKET": str(daemon.socket)}  # its data path is another, empty one
    listed = sandboxd("tools", "list", "--json", "--user", user, cwd=tmp_path, env=second_terminal)
    assert listed.returncode == 0, listed.stderr
    names = [tool["name"] for tool in json.loads(listed.stdout)["tools"]]
    assert "mine" in names and "hello" in names
    assert f"tools as the daemon at {daemon.socket} serves them" in listed.stderr
    shown = sandboxd("tools", "show", "mine", "--json", "--user", user, cwd=tmp_path, env=second_terminal)
    assert shown.returncode == 0 and json.loads(shown.stdout)["source"] == "user", shown.stderr

    daemon.stop()
    listed = sandboxd("tools", "list", "--json", "--user", user, cwd=tmp_path, env=second_terminal)
    assert listed.returncode == 0 and json.loads(listed.stdout) == {"tools": []}, listed.stderr
    assert f"no daemon answers at {daemon.socket}" in listed.stderr
    assert f"reading the tools from the disk in {tmp_path / 'data'}" in listed.stderr


def test_the_sandbox_and_validate_give_the_same_export_fix(tmp_path: Path, env: dict[str, str]) -> None:
    """One source for the fix text (images/node/shim/src/fixes.json): the image's shim and the linter agree."""
    from sandboxd.dev.lint import EXECUTE_SIGNATURE, EXPORT_FIX

    write_tool(tmp_path, "classy", "export class MyTool { async run() { return 1; } }\n")
    ran = sandboxd("run", "classy", cwd=tmp_path, env=env)
    assert ran.returncode == 1 and "Class-based tools are not supported" in ran.stdout, (ran.stdout, ran.stderr)
    assert ran.stdout.rstrip("\n").endswith("; " + EXPORT_FIX)  # the shim's load-time error, from the image
    [finding] = [line for line in ran.stderr.splitlines() if line.startswith("classy/index.ts:1: error: class-pattern:")]
    assert finding.endswith(EXECUTE_SIGNATURE)  # the linter's fix names the same signature
