"""`sandboxd tools list|show`, `sandboxd sync`, `sandboxd validate`: run in-process, plus one real subprocess."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
from pathlib import Path
from typing import Any, Iterator

import pytest

from sandboxd.cli.main import main
from sandboxd.dev.lint.validation import validate_paths

REPO = Path(__file__).resolve().parents[2]
SEED = REPO / "seed" / "tools"
USER = "alice@example.com"

HELLO_PROTOCOL = {
    "name": "hello",
    "label": "Hello",
    "description": "Says hello to the user. Use this when the user wants a greeting.",
    "version": 1,
    "language": "typescript",
    "source": "global",
    "inputSchema": {
        "type": "object",
        "properties": {"name": {"type": "string", "description": "Who to greet."}},
        "required": ["name"],
        "additionalProperties": False,
    },
    "documentation": "# Hello Tool\n\nGreets the user by name.\n\n## Usage\n\n"
                     "Call with a `name` parameter to get a personalized greeting.",
    "permissions": {"network": [], "env": [], "email": "none", "browser": False},
}

USER_TOOL_MD = """---
name: lookup
label: Lookup
description: Looks things up.
version: 3
inputs:
  query:
    type: string
    description: What to look up.
  limit:
    type: number
    description: Most results.
    optional: true
    default: 10
  token:
    type: string
    description: API token.
    optional: true
    sensitive: true
  mode:
    type: enum
    values: [fast, thorough]
    description: How hard to look.
---

# Lookup
"""

LOOKUP_PROTOCOL = {
    "name": "lookup",
    "label": "Lookup",
    "description": "Looks things up.",
    "version": 3,
    "language": "typescript",
    "source": "user",
    "inputSchema": {
        "type": "object",
        "properties": {
            "query": {"type": "string", "description": "What to look up."},
            "limit": {"type": "number", "description": "Most results.", "default": 10},
            "token": {"type": "string", "description": "API token.", "writeOnly": True},
            "mode": {"type": "string", "enum": ["fast", "thorough"], "description": "How hard to look."},
        },
        "required": ["query", "mode"],
        "additionalProperties": False,
    },
    "documentation": "# Lookup",
    "permissions": None,
}


pytestmark = pytest.mark.usefixtures("isolated_config")

@pytest.fixture
def data(tmp_path: Path) -> Path:
    """A data path with the seed's hello installed and one user tool."""
    data = tmp_path / "data"
    seed = tmp_path / "seed"
    shutil.copytree(SEED / "hello", seed / "hello")  # the seed grows; these tests pin what they list
    assert main(["sync", "--data-path", str(data), "--seed-tools", str(seed)]) == 0
    lookup = data / USER / "tools" / "lookup"
    lookup.mkdir(parents=True)
    (lookup / "TOOL.md").write_text(USER_TOOL_MD)
    (lookup / "index.js").write_text("export async function execute() {}\n")
    return data


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


# An entry file the code checks accept, so these tests see the manifest's problems alone.
VALID_ENTRY = "export async function execute() {\n  return { content: [] };\n}\n"


def write_bad_tool(root: Path) -> Path:
    bad = root / "bad"
    bad.mkdir(parents=True)
    (bad / "TOOL.md").write_text("---\nname: Bad\nversion: '2'\n---\n# Bad\n")
    (bad / "index.ts").write_text(VALID_ENTRY)
    return bad


# --- tools list --------------------------------------------------------------------------------


def test_list_json_is_exactly_the_tools_list_result(data: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(capsys, "tools", "list", "--json", "--data-path", str(data), "--user", USER)
    assert code == 0
    assert json.loads(out) == {"tools": [HELLO_PROTOCOL, LOOKUP_PROTOCOL]}
    assert out.startswith('{\n  "tools": [')  # indented by 2


def test_list_json_without_user_has_only_global_tools(data: Path, capsys: pytest.CaptureFixture[str]) -> None:
    _, out, _ = run(capsys, "tools", "list", "--json", "--data-path", str(data))
    assert json.loads(out) == {"tools": [HELLO_PROTOCOL]}


def test_list_all_json_adds_the_skipped_directories(data: Path, capsys: pytest.CaptureFixture[str]) -> None:
    write_bad_tool(data / "tools")
    _, out, _ = run(capsys, "tools", "list", "--json", "--data-path", str(data))
    assert "skipped" not in json.loads(out)
    _, out, _ = run(capsys, "tools", "list", "--json", "--all", "--data-path", str(data))
    result = json.loads(out)
    assert result["tools"] == [HELLO_PROTOCOL]
    [skipped] = result["skipped"]
    assert skipped["dir"] == str(data / "tools" / "bad") and skipped["source"] == "global"
    assert [p["field"] for p in skipped["problems"]] == ["description", "name", "version"]
    assert set(skipped["problems"][0]) == {"path", "line", "field", "severity", "message", "fix"}


def test_list_prints_a_table(data: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(capsys, "tools", "list", "--data-path", str(data), "--user", USER)
    lines = out.splitlines()
    assert code == 0
    assert lines[0].split() == ["NAME", "VERSION", "SOURCE", "PERMISSIONS", "DESCRIPTION"]
    assert lines[1].split()[:4] == ["hello", "1", "global", "none"] and lines[1].endswith("wants a greeting.")
    assert lines[2].split() == ["lookup", "3", "user", "undeclared", "Looks", "things", "up."]


def test_list_all_prints_why_directories_are_skipped(data: Path, capsys: pytest.CaptureFixture[str]) -> None:
    write_bad_tool(data / "tools")
    _, out, _ = run(capsys, "tools", "list", "--all", "--data-path", str(data))
    assert f"skipped {data / 'tools' / 'bad'} (global):" in out
    assert "version must be an integer" in out and "Fix:" in out


def test_list_with_no_tools_says_how_to_get_some(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(capsys, "tools", "list", "--data-path", str(tmp_path / "empty"))
    assert code == 0 and "sandboxd sync" in out


def test_a_malformed_user_is_a_usage_error(data: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        main(["tools", "list", "--data-path", str(data), "--user", "not-an-email"])
    assert exited.value.code == 2
    assert "not an email address" in capsys.readouterr().err


# --- tools show --------------------------------------------------------------------------------


def test_show_prints_metadata_schema_and_documentation(data: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(capsys, "tools", "show", "lookup", "--data-path", str(data), "--user", USER)
    assert code == 0
    assert out.startswith("lookup — Lookup\n")
    for expected in ("version:     3", "source:      user", f"path:        {data / USER / 'tools' / 'lookup'}",
                     "entry:       index.js", '"writeOnly": true', "# Lookup"):
        assert expected in out
    schema_text = out.split("inputSchema:\n", 1)[1].split("\n\ndocumentation:", 1)[0]
    assert json.loads(schema_text) == LOOKUP_PROTOCOL["inputSchema"]


def test_show_json_is_the_protocol_tool_object(data: Path, capsys: pytest.CaptureFixture[str]) -> None:
    _, out, _ = run(capsys, "tools", "show", "hello", "--json", "--data-path", str(data))
    assert json.loads(out) == HELLO_PROTOCOL


def test_show_an_unknown_tool_fails_and_points_to_list(data: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run(capsys, "tools", "show", "nope", "--data-path", str(data))
    assert (code, out) == (1, "")
    assert err == (f"sandboxd: reading the tools from the disk in {data}\n"
                   "sandboxd: unknown tool nope; `sandboxd tools list` shows the tools\n")


def test_show_a_user_tool_without_the_user_is_unknown(data: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, _, _ = run(capsys, "tools", "show", "lookup", "--data-path", str(data))
    assert code == 1


def test_show_a_skipped_tool_says_why(data: Path, capsys: pytest.CaptureFixture[str]) -> None:
    write_bad_tool(data / "tools")
    code, _, err = run(capsys, "tools", "show", "bad", "--data-path", str(data))
    assert code == 1 and "is skipped" in err and "description is required" in err


# --- sync --------------------------------------------------------------------------------------


def test_sync_prints_one_line_per_tool(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    seed = tmp_path / "seed"
    for name, version in (("alpha", 1), ("beta", 2)):
        (seed / name).mkdir(parents=True)
        (seed / name / "TOOL.md").write_text(f"---\nname: {name}\ndescription: D.\nversion: {version}\n---\n")
    data = ["--data-path", str(tmp_path / "data"), "--seed-tools", str(seed)]
    assert run(capsys, "sync", *data) == (0, "installed alpha (v1)\ninstalled beta (v2)\n", "")
    (seed / "alpha" / "TOOL.md").write_text("---\nname: alpha\ndescription: D.\nversion: 2\n---\n")
    assert run(capsys, "sync", *data) == (0, "updated alpha (v1 → v2)\nkept beta (v2, seed v2)\n", "")


def test_sync_uses_the_configured_seed(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                       monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SANDBOXD_SEED_TOOLS", str(SEED))
    code, out, _ = run(capsys, "sync", "--data-path", str(tmp_path / "data"))
    assert code == 0 and "installed hello (v1)" in out


def test_sync_without_a_seed_directory_fails_clearly(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SANDBOXD_SEED_TOOLS", "")  # configured as none
    code, _, err = run(capsys, "sync", "--data-path", str(tmp_path / "data"))
    assert code == 1 and "no seed tools directory is configured; pass --seed-tools DIR" in err


def test_sync_with_a_missing_seed_directory_fails_clearly(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = run(capsys, "sync", "--data-path", str(tmp_path / "data"), "--seed-tools", str(tmp_path / "nope"))
    assert code == 1 and "does not exist" in err
    assert not (tmp_path / "data").exists()


# --- validate ----------------------------------------------------------------------------------


def test_the_shipped_seed_validates_clean(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run(capsys, "validate", str(SEED))
    assert (code, out) == (0, "0 errors, 0 warnings\n") and err.startswith("sandboxd: version bumps "), err
    assert run(capsys, "validate", str(SEED / "hello"), str(SEED / "hello" / "TOOL.md"))[0] == 0


def test_validate_prints_every_problem_and_fails_on_errors(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bad = write_bad_tool(tmp_path / "tools")
    code, out, _ = run(capsys, "validate", str(bad))
    assert code == 1
    assert out.splitlines() == [
        f"{bad}/TOOL.md: error: description: description is required. "
        "Fix: add 'description: <what the tool does and when the agent should use it>'",
        f"{bad}/TOOL.md:2: error: name: name 'Bad' is not snake_case (lowercase letters, digits and _, starting with a "
        "letter). Fix: rename it: 'name: bad'",
        f"{bad}/TOOL.md:3: error: version: version must be an integer, got \"2\". "
        "Fix: write a whole number without quotes, e.g. 'version: 2'",
        "3 errors, 0 warnings",
    ]


def test_validate_passes_with_warnings_but_prints_them(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    tool = tmp_path / "nover"
    tool.mkdir()
    (tool / "TOOL.md").write_text("---\nname: nover\ndescription: D.\n---\n# Doc\n")
    (tool / "index.ts").write_text("")
    code, out, _ = run(capsys, "validate", str(tool / "TOOL.md"))
    assert code == 0
    assert "warning: version: version is missing" in out and out.endswith("0 errors, 1 warning\n")


def test_validate_a_root_flags_incomplete_directories_and_shadowed_names(tmp_path: Path) -> None:
    root = tmp_path / "tools"
    for dirname in ("a_one", "b_two"):
        (root / dirname).mkdir(parents=True)
        (root / dirname / "TOOL.md").write_text("---\nname: same\ndescription: D.\nversion: 1\n---\n# D\n")
        (root / dirname / "index.ts").write_text(VALID_ENTRY)
    (root / "no_entry").mkdir()
    (root / "no_entry" / "TOOL.md").write_text("---\nname: no_entry\ndescription: D.\nversion: 1\n---\n# D\n")
    (root / "no_manifest").mkdir()
    (root / "no_manifest" / "index.ts").write_text(VALID_ENTRY)
    (root / ".hidden").mkdir()
    problems = validate_paths([root])
    assert [(p.path.relative_to(root).parts[0], p.severity) for p in problems] == [
        ("a_one", "error"), ("no_entry", "error"), ("no_manifest", "error")]
    assert "also declared in b_two/" in problems[0].message
    assert "no entry file" in problems[1].message and problems[2].message == "no TOOL.md"


def test_validate_a_tool_directory_missing_its_manifest(tmp_path: Path) -> None:
    (tmp_path / "tool").mkdir()
    (tmp_path / "tool" / "index.ts").write_text(VALID_ENTRY)
    [problem] = validate_paths([tmp_path / "tool"])
    assert problem.message == "no TOOL.md" and "name, description and version" in problem.fix


def test_validate_an_empty_directory_or_a_missing_path(tmp_path: Path) -> None:
    (tmp_path / "empty").mkdir()
    problems = validate_paths([tmp_path / "empty", tmp_path / "missing"])
    assert [p.message for p in problems] == ["holds no TOOL.md and no tool directories", "does not exist"]


def test_validate_json(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bad = write_bad_tool(tmp_path / "tools")
    code, out, _ = run(capsys, "validate", "--json", str(bad))
    problems = json.loads(out)["problems"]
    assert code == 1
    assert [(p["field"], p["line"], p["severity"]) for p in problems] == [
        ("description", None, "error"), ("name", 2, "error"), ("version", 3, "error")]


# --- usage -------------------------------------------------------------------------------------


@pytest.mark.parametrize("argv", [["tools", "--help"], ["tools", "list", "--help"], ["tools", "show", "--help"],
                                  ["sync", "--help"], ["validate", "--help"]])
def test_every_command_has_help(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        main(argv)
    assert exited.value.code == 0 and "usage: sandboxd" in capsys.readouterr().out


@pytest.mark.parametrize("argv", [["tools"], ["tools", "show"], ["validate"], ["tools", "list", "--bogus"]])
def test_usage_errors_exit_2(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        main(argv)
    assert exited.value.code == 2


# --- a real process ----------------------------------------------------------------------------


def test_tools_list_json_in_a_real_process(data: Path, tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SANDBOXD_")}
    env["SANDBOXD_CONFIG"] = str(tmp_path / "empty-config.yaml")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    completed = subprocess.run(
        [sys.executable, "-m", "sandboxd", "tools", "list", "--json", "--data-path", str(data), "--user", USER],
        capture_output=True, text=True, env=env, cwd=tmp_path, timeout=60, check=False)
    assert completed.returncode == 0, completed.stderr
    assert json.loads(completed.stdout) == {"tools": [HELLO_PROTOCOL, LOOKUP_PROTOCOL]}


def test_validate_warns_where_the_daemon_would_skip_tools_of_a_root(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from sandboxd.dev.lint import validation

    monkeypatch.setattr(validation, "MAX_ENTRIES_PER_ROOT", 2)
    monkeypatch.setattr(validation, "MAX_ROOT_MANIFEST_BYTES", 100)
    root = tmp_path / "tools"
    for dirname in ("a", "b", "c"):
        (root / dirname).mkdir(parents=True)
        (root / dirname / "TOOL.md").write_text(f"---\nname: {dirname}\ndescription: D.\nversion: 1\n---\n# D\n")
        (root / dirname / "index.ts").write_text(VALID_ENTRY)
    problems = validate_paths([root])
    assert [(p.path, p.severity) for p in problems] == [(root, "warning"), (root, "warning")]
    assert "holds 3 tools" in problems[0].message and "add up to" in problems[1].message


def test_validate_reports_a_yaml_bomb_at_once(tmp_path: Path) -> None:
    from tests.unit.test_manifest import yaml_bomb

    tool = tmp_path / "bomb"
    tool.mkdir()
    (tool / "TOOL.md").write_text("---\n" + yaml_bomb() + "---\n# Bomb\n")
    (tool / "index.ts").write_text(VALID_ENTRY)
    problems = validate_paths([tool])
    assert any("anchors and aliases" in p.message for p in problems)


# --- tools list / show ask a running daemon first (issue 14) ----------------------------------

class FakeDaemon:
    """A unix socket that answers tools/list like the daemon: canned tools, or an error, or silence."""

    def __init__(self, path: Path, tools: list[dict[str, Any]] | None = None, error: str | None = None,
                 silent: bool = False) -> None:
        self.path, self.tools, self.error, self.silent = path, tools or [], error, silent
        self.requests: list[dict[str, Any]] = []
        self.server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.server.bind(str(path))
        self.server.listen()
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.server.accept()
            except OSError:
                return
            with conn:
                data = b""
                while b"\n" not in data:
                    chunk = conn.recv(65536)
                    if not chunk:
                        break
                    data += chunk
                if not data:
                    continue
                request = json.loads(data.split(b"\n")[0])
                self.requests.append(request)
                if self.silent:
                    conn.recv(1)  # hold the connection open without answering, until the client gives up
                    continue
                if self.error is not None:
                    reply = {"jsonrpc": "2.0", "id": request["id"], "error": {"code": -32602, "message": self.error}}
                else:
                    reply = {"jsonrpc": "2.0", "id": request["id"], "result": {"tools": self.tools}}
                conn.sendall(json.dumps(reply).encode() + b"\n")

    def close(self) -> None:
        self.server.close()


@pytest.fixture
def short_socket() -> Iterator[Path]:
    directory = Path(tempfile.mkdtemp(prefix="sbd-"))  # unix socket paths are limited to 108 bytes
    yield directory / "sandboxd.sock"
    shutil.rmtree(directory, ignore_errors=True)


SERVED_TOOL = {**HELLO_PROTOCOL, "name": "served_only", "label": "Served Only", "description": "Only the daemon has it."}


def test_list_asks_the_daemon_at_the_socket(short_socket: Path, capsys: pytest.CaptureFixture[str]) -> None:
    daemon = FakeDaemon(short_socket, tools=[SERVED_TOOL])
    try:
        code, out, err = run(capsys, "tools", "list", "--socket", str(short_socket), "--user", USER)
    finally:
        daemon.close()
    assert code == 0 and out.splitlines()[1].split()[:3] == ["served_only", "1", "global"]
    assert f"tools as the daemon at {short_socket} serves them" in err
    assert daemon.requests[0]["method"] == "tools/list" and daemon.requests[0]["params"] == {"user": USER}


def test_list_json_from_the_daemon_is_its_answer(short_socket: Path, capsys: pytest.CaptureFixture[str]) -> None:
    daemon = FakeDaemon(short_socket, tools=[SERVED_TOOL])
    try:
        code, out, _ = run(capsys, "tools", "list", "--json", "--socket", str(short_socket))
    finally:
        daemon.close()
    assert code == 0 and json.loads(out) == {"tools": [SERVED_TOOL]} and daemon.requests[0]["params"] == {}


def test_show_asks_the_daemon(short_socket: Path, capsys: pytest.CaptureFixture[str]) -> None:
    daemon = FakeDaemon(short_socket, tools=[SERVED_TOOL])
    try:
        code, out, _ = run(capsys, "tools", "show", "served_only", "--json", "--socket", str(short_socket))
        assert code == 0 and json.loads(out) == SERVED_TOOL
        code, out, _ = run(capsys, "tools", "show", "served_only", "--socket", str(short_socket))
        assert code == 0 and out.startswith("served_only — Served Only\n") and "\"name\"" in out
        code, _, err = run(capsys, "tools", "show", "hello", "--socket", str(short_socket))
        assert code == 1 and "the daemon serves no tool hello" in err and "--user" in err
    finally:
        daemon.close()


def test_without_a_daemon_the_disk_is_read_and_said(data: Path, short_socket: Path, monkeypatch: pytest.MonkeyPatch,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("SANDBOXD_DATA_PATH", str(data))
    code, out, err = run(capsys, "tools", "list", "--json", "--socket", str(short_socket), "--user", USER)
    assert code == 0 and json.loads(out) == {"tools": [HELLO_PROTOCOL, LOOKUP_PROTOCOL]}
    assert f"no daemon answers at {short_socket}" in err and f"reading the tools from the disk in {data}" in err


def test_a_daemon_that_does_not_answer_is_given_up_on(data: Path, short_socket: Path,
                                                      monkeypatch: pytest.MonkeyPatch,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    from sandboxd.cli import tools_cmds

    monkeypatch.setattr(tools_cmds, "DAEMON_TIMEOUT_S", 0.5)
    monkeypatch.setenv("SANDBOXD_DATA_PATH", str(data))
    daemon = FakeDaemon(short_socket, silent=True)
    try:
        code, out, err = run(capsys, "tools", "list", "--json", "--socket", str(short_socket))
    finally:
        daemon.close()
    assert code == 0 and json.loads(out) == {"tools": [HELLO_PROTOCOL]}
    assert f"no daemon answers at {short_socket}" in err and "timed out" in err


def test_a_daemon_error_is_reported_not_papered_over(short_socket: Path, capsys: pytest.CaptureFixture[str]) -> None:
    daemon = FakeDaemon(short_socket, error="user is not valid")
    try:
        code, out, err = run(capsys, "tools", "list", "--socket", str(short_socket))
    finally:
        daemon.close()
    assert (code, out) == (1, "") and "the daemon at" in err and "refused tools/list: user is not valid" in err


@pytest.mark.parametrize("flags", [["--disk"], ["--data-path", "{data}"], ["--all"]])
def test_disk_flags_skip_the_daemon(data: Path, short_socket: Path, monkeypatch: pytest.MonkeyPatch,
                                    capsys: pytest.CaptureFixture[str], flags: list[str]) -> None:
    monkeypatch.setenv("SANDBOXD_DATA_PATH", str(data))
    monkeypatch.setenv("SANDBOXD_SOCKET", str(short_socket))
    daemon = FakeDaemon(short_socket, tools=[SERVED_TOOL])
    try:
        code, out, err = run(capsys, "tools", "list", "--json", *(f.format(data=data) for f in flags))
    finally:
        daemon.close()
    assert code == 0 and [t["name"] for t in json.loads(out)["tools"]] == ["hello"]
    assert daemon.requests == [] and f"reading the tools from the disk in {data}" in err


# --- what a person reads: no wire codes, counts in the right number (issue 29) -------------------


def test_a_daemon_error_reads_as_its_message_without_the_wire_code(short_socket: Path,
                                                                   capsys: pytest.CaptureFixture[str]) -> None:
    message = 'invalid arguments for tool "hello": "name" is required (string: Who to greet.)'
    daemon = FakeDaemon(short_socket, error=message)
    try:
        code, out, err = run(capsys, "call", "--user", USER, "hello", "--socket", str(short_socket))
    finally:
        daemon.close()
    assert (code, out, err) == (2, "", f"sandboxd: {message}\n")


def test_status_counts_agree_in_number() -> None:
    from sandboxd.cli.client_cmds import format_status

    def status(n: int) -> dict[str, Any]:
        totals = {"idle": 0, "busy": n, "starting": 0, "stopping": 0, "waiting": n}
        sharing = {"reserve": 4, "activeUsers": n, "fairShare": n}
        return {"version": "0.4.0", "backend": "docker", "transport": "socket", "uptimeS": 1.0, "connections": n,
                "callsInFlight": n, "calls": {}, "pool": {"totals": totals, "users": {}, "counters": {},
                                                        "sharing": sharing, "refusals": {"reserve": n}},
                "limits": {"maxPerUser": n, "maxTotal": 32, "minIdle": 1, "idleTtlS": 300.0,
                           "defaultTimeoutMs": 30000, "maxTimeoutMs": 600000}}

    one, two = format_status(status(1)), format_status(status(2))
    assert "1 connection, 1 call in flight" in one and "; 1 call queued" in one and "1 sandbox per user" in one, one
    assert "2 connections, 2 calls in flight" in two and "; 2 calls queued" in two and "2 sandboxes per user" in two
    assert "sharing: 1 user active, a fair share of 1 sandbox each, the last 4 kept for first calls" in one, one
    assert "sharing: 2 users active, a fair share of 2 sandboxes each" in two and "2 by the reserve" in two, two
