"""PROTOCOL.md end to end: a real daemon, real sockets, real Docker containers."""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
import threading
import time
from typing import Any

import pytest

from sandboxd.client import Client, RpcError

from tests.e2e.conftest import READ_ONLY_REFUSALS, REPO, Daemon, write_tool
from tests.e2e.hostile_harness import wait_until

pytestmark = pytest.mark.docker

A, B = "alice@example.com", "bob@example.com"


def raw_exchange(daemon: Daemon, payload: bytes, replies: int = 1, timeout: float = 10) -> list[dict[str, Any]]:
    """Send raw bytes, read `replies` lines back."""
    with socket.socket(socket.AF_UNIX) as sock:
        sock.settimeout(timeout)
        sock.connect(str(daemon.socket))
        sock.sendall(payload)
        buffer, out = b"", []
        while len(out) < replies:
            chunk = sock.recv(65536)
            assert chunk, f"connection closed after {out}"
            buffer += chunk
            while b"\n" in buffer and len(out) < replies:
                line, buffer = buffer.split(b"\n", 1)
                out.append(json.loads(line))
        return out


def call(client: Client, name: str, arguments: dict[str, Any] | None = None, user: str = A, **extra: Any) -> dict[str, Any]:
    return client.call_tool(user, name, arguments or {}, **extra)


def start_running(client: Client, request_id: Any, name: str, arguments: dict[str, Any], user: str = A) -> None:
    """Start a call of a tool that reports progress first (announcer, stubborn); return once it runs."""
    client.send({"jsonrpc": "2.0", "id": request_id, "method": "tools/call",
                 "params": {"user": user, "name": name, "arguments": arguments}})
    message = client.read_message()
    assert message.get("method") == "notifications/progress", f"{name} answered before it said it runs: {message}"


# -- the basics -------------------------------------------------------------------


def test_ping_list_and_status(daemon: Daemon) -> None:
    with daemon.client() as client:
        assert client.request("ping") == {}
        tools = client.request("tools/list")["tools"]
        names = [t["name"] for t in tools]
        assert names == sorted(names) and "hello" in names
        hello = next(t for t in tools if t["name"] == "hello")
        assert hello["source"] == "global" and hello["version"] == 1 and hello["language"] == "typescript"
        assert hello["inputSchema"] == {
            "type": "object",
            "properties": {"name": {"type": "string", "description": "Who to greet."}},
            "required": ["name"],
            "additionalProperties": False,
        }
        assert hello["documentation"].startswith("# Hello Tool")
        status = client.request("sandbox/status")
        assert status["backend"] == "docker" and status["transport"] == "socket" and status["version"]
        assert status["pool"]["totals"] == {"starting": 0, "idle": 0, "busy": 0, "stopping": 0, "waiting": 0,
                                           "holding": 0}


def test_hello_round_trip_and_warm_pool(daemon: Daemon) -> None:
    with daemon.client() as client:
        result = call(client, "hello", {"name": "World"})
        assert result["content"] == [{"type": "text", "text": "Hello, World!"}]
        assert result["status"] == "ok" and result["isError"] is False
        assert isinstance(result["durationMs"], int)

        # min_idle (1) counts spares beside the busy ones: while the call ran, a spare started,
        # so two are idle now. Without min_idle only the one the call used would be.
        def warmed() -> dict[str, Any] | None:
            pool = client.request("sandbox/status")["pool"]
            return pool if pool["totals"]["idle"] == 2 else None

        pool = wait_until(warmed, 30, "min_idle to warm a spare sandbox")
        assert pool["totals"]["busy"] == 0 and pool["counters"]["started"] == 2


def test_the_start_up_log_names_the_config_file_the_egress_policy_and_the_one_version(make_daemon: Any) -> None:
    """Issue 29: the start-up log never said which file was loaded or what sandboxes may reach;
    `listening` names the daemon's version and the image it runs, which are one version."""
    from sandboxd import __version__
    from sandboxd.config import RUNNER_IMAGE

    daemon = make_daemon("egress:\n  policy: allow-list\n  allow: ['searxng.internal:8080']\n",
                         env={"SANDBOXD_POOL_MIN_IDLE": "0"})
    [configuration] = daemon.events("configuration")
    assert configuration["file"] == str(daemon.config_path)
    assert configuration["environment"] == ["SANDBOXD_POOL_MIN_IDLE"]  # names only, never values
    assert configuration["flags"] == ["--data-path", "--seed-tools", "--socket"]
    assert (configuration["egress_policy"], configuration["egress_allow"]) == ("allow-list", ["searxng.internal:8080"])
    assert configuration["sandbox_network"] == "none" and configuration["data_path"] == str(daemon.data)
    listening = daemon.events("listening")[-1]
    assert (listening["version"], listening["image"]) == (__version__, RUNNER_IMAGE)
    assert RUNNER_IMAGE == f"sandboxd/node:{__version__}"


@pytest.mark.parametrize("loop", ["uvloop", "asyncio"])
def test_either_event_loop_serves_calls_progress_and_cancels(make_daemon: Any, loop: str) -> None:
    """event_loop: uvloop is the default (auto); asyncio stays a working choice, not a dead branch."""
    daemon = make_daemon(env={"SANDBOXD_EVENT_LOOP": loop})
    assert daemon.events("listening")[-1]["event_loop"] == loop
    with daemon.client() as client:
        assert call(client, "hello", {"name": loop})["content"] == [{"type": "text", "text": f"Hello, {loop}!"}]
        seen: list[dict[str, Any]] = []
        result = client.request("tools/call", {"user": A, "name": "progress", "arguments": {"steps": 3}},
                                on_progress=seen.append)
        assert result["status"] == "ok" and len(seen) == 3, (result, seen)
        start_running(client, 7, "announcer", {"ms": 60000})
        client.cancel(7, "stop")
        cancelled = client.read_message()
        assert cancelled["id"] == 7 and cancelled["result"]["status"] == "cancelled", cancelled
        assert cancelled["result"]["details"]["aborted"] is True


def test_cli_call_prints_the_result(daemon: Daemon) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "sandboxd", "call", "--socket", str(daemon.socket), "--user", A, "hello", "--arg", "name=World"],
        capture_output=True, text=True, timeout=60, cwd=REPO,
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "Hello, World!"
    failed = subprocess.run(
        [sys.executable, "-m", "sandboxd", "call", "--socket", str(daemon.socket), "--user", A, "thrower"],
        capture_output=True, text=True, timeout=60, cwd=REPO,
    )
    assert failed.returncode == 1 and "the database is on fire" in failed.stdout
    usage = subprocess.run(
        [sys.executable, "-m", "sandboxd", "call", "--socket", str(daemon.socket), "--user", A, "nope"],
        capture_output=True, text=True, timeout=60, cwd=REPO,
    )
    assert usage.returncode == 2 and "unknown tool" in usage.stderr


def test_user_tool_overrides_global(daemon: Daemon) -> None:
    write_tool(daemon.user_dir(A) / "tools", "hello",
               "export async function execute() { return { content: [{ type: 'text', text: 'mine' }] }; }",
               description="Alice's own hello.")
    with daemon.client() as client:
        listed = {t["name"]: t for t in client.request("tools/list", {"user": A})["tools"]}
        assert listed["hello"]["source"] == "user"
        assert call(client, "hello")["content"][0]["text"] == "mine"
        assert call(client, "hello", {"name": "Bob"}, user=B)["content"][0]["text"] == "Hello, Bob!"


# -- progress and concurrency -------------------------------------------------------


def test_progress_notifications_in_order_before_the_result(daemon: Daemon) -> None:
    with daemon.client() as client:
        client.send({"jsonrpc": "2.0", "id": "p1", "method": "tools/call",
                     "params": {"user": A, "name": "progress", "arguments": {"steps": 5}, "_meta": {"progressToken": "tok"}}})
        messages = []
        while True:
            message = client.read_message()
            messages.append(message)
            if message.get("id") == "p1":
                break
        progress = [m["params"] for m in messages[:-1]]
        assert [p["progress"] for p in progress] == [1, 2, 3, 4, 5]
        assert all(p["progressToken"] == "tok" for p in progress)
        assert [p["content"][0]["text"] for p in progress] == [f"step {i}" for i in range(1, 6)]
        assert messages[-1]["result"]["content"][0]["text"] == "did 5 steps"
        # Without a progressToken, the request id is the token.
        tokens = []
        call(client, "progress", {"steps": "2"})  # "2" is coerced to 2
        client.request("tools/call", {"user": A, "name": "progress", "arguments": {"steps": 1}},
                       on_progress=lambda p: tokens.append(p["progressToken"]))
        assert tokens == [2]  # the client numbers its requests 1, 2, ...


def test_many_calls_in_flight_answer_out_of_order(make_daemon: Any) -> None:
    daemon = make_daemon("pool:\n  max_per_user: 3\n")
    with daemon.client() as client:
        # Evidence, not a race of cold starts against sleeps: the long call runs (it said so)
        # for a minute, and the short ones sent after it answer first.
        start_running(client, 1, "announcer", {"ms": 60000})
        client.send({"jsonrpc": "2.0", "id": 2, "method": "tools/call",
                     "params": {"user": A, "name": "sleeper", "arguments": {"ms": 10}}})
        client.send({"jsonrpc": "2.0", "id": 3, "method": "tools/call",
                     "params": {"user": A, "name": "hello", "arguments": {"name": "x"}}})
        assert sorted(client.read_message()["id"] for _ in range(2)) == [2, 3]
        client.cancel(1)
        assert client.read_message()["result"]["details"]["aborted"] is True  # still running till then
        assert client.request("ping") == {}


# -- errors ------------------------------------------------------------------------


def test_protocol_errors_keep_the_connection(daemon: Daemon) -> None:
    replies = raw_exchange(daemon, b"".join([
        b"this is not json\n",
        b'[{"jsonrpc":"2.0","id":1,"method":"ping"}]\n',
        b'{"id":2,"method":"ping"}\n',
        b'{"jsonrpc":"2.0","id":3,"method":"no/such"}\n',
        b'{"jsonrpc":"2.0","id":4,"method":"ping"}\r\n',
        b'{"jsonrpc":"2.0","id":5,"method":"tools/call","params":{"user":"alice@example.com","name":"hello","arguments":{"name":"\xe2\x80\xa8x"}}}\n',
    ]), replies=6)
    by_id = {r.get("id"): r for r in replies}
    codes = [r["error"]["code"] for r in replies if r.get("id") is None]
    assert sorted(codes) == [-32700, -32600]
    assert by_id[2]["error"]["code"] == -32600
    assert by_id[3]["error"]["code"] == -32601
    assert by_id[4]["result"] == {}
    assert by_id[5]["result"]["content"][0]["text"] == "Hello, \u2028x!"


def test_oversized_message_is_skipped(make_daemon: Any) -> None:
    daemon = make_daemon("max_message_bytes: 4096\n")
    big = b'{"jsonrpc":"2.0","id":1,"method":"ping","params":{"x":"' + b"a" * 10000 + b'"}}\n'
    replies = raw_exchange(daemon, big + b'{"jsonrpc":"2.0","id":2,"method":"ping"}\n', replies=2)
    assert replies[0]["error"]["code"] == -32600 and "longer than 4096" in replies[0]["error"]["message"]
    assert replies[1] == {"jsonrpc": "2.0", "id": 2, "result": {}}


@pytest.mark.parametrize(
    ("params", "fragment"),
    [
        ({"user": A, "name": "nope", "arguments": {}}, "unknown tool 'nope'"),
        ({"user": A, "name": "hello", "arguments": {}}, "name"),
        ({"user": A, "name": "progress", "arguments": {"steps": "many", "extra": 1}}, "steps"),
        ({"user": "../etc", "name": "hello", "arguments": {"name": "x"}}, "email address"),
        ({"user": "a..b@example.com", "name": "hello", "arguments": {"name": "x"}}, "email address"),
        ({"user": A, "name": "hello", "arguments": {"name": "x"}, "env": {"HOME": "/root"}}, "HOME"),
        ({"user": A, "name": "hello", "arguments": {"name": "x"}, "env": {"LD_PRELOAD": "/x.so"}}, "LD_PRELOAD"),
    ],
)
def test_bad_params_are_32602(daemon: Daemon, params: dict[str, Any], fragment: str) -> None:
    with daemon.client() as client:
        with pytest.raises(RpcError) as info:
            client.request("tools/call", params)
        assert info.value.code == -32602
        assert fragment in info.value.message
        assert client.request("ping") == {}


def test_invalid_arguments_list_every_violation(daemon: Daemon) -> None:
    with daemon.client() as client:
        with pytest.raises(RpcError) as info:
            client.request("tools/call", {"user": A, "name": "progress", "arguments": {"steps": "x", "bogus": 1}})
        assert "steps" in info.value.message and "bogus" in info.value.message


def test_tool_errors_map_to_statuses(make_daemon: Any) -> None:
    daemon = make_daemon("sandbox:\n  memory: 96m\n")
    with daemon.client() as client:
        thrown = call(client, "thrower")
        assert thrown["status"] == "error" and thrown["isError"] is True
        assert "the database is on fire" in thrown["content"][0]["text"]
        exited = call(client, "exiter", {"code": 3})
        assert exited["status"] == "crashed" and exited["isError"] is True
        assert "code 3" in exited["content"][0]["text"]
        hog = call(client, "memory_hog", timeoutMs=60000)
        assert hog["status"] == "crashed"
        assert "memory" in hog["content"][0]["text"] and "96m" in hog["content"][0]["text"]
        assert call(client, "hello", {"name": "again"})["status"] == "ok"


def test_overloaded_is_32001(make_daemon: Any) -> None:
    # The queue deadline also bounds a cold start, so it is generous for a busy machine;
    # the held call outlasts it by far.
    daemon = make_daemon("pool:\n  max_per_user: 1\n  min_idle: 0\n  acquire_timeout_ms: 2000\n")
    with daemon.client() as first, daemon.client() as second:
        assert call(first, "hello", {"name": "warm"})["status"] == "ok"
        start_running(first, 1, "announcer", {"ms": 8000})  # holds alice's one sandbox
        with pytest.raises(RpcError) as info:
            call(second, "hello", {"name": "x"})
        assert info.value.code == -32001
        assert first.read_message()["result"]["status"] == "ok"


def test_backend_down_is_32002(make_daemon: Any) -> None:
    daemon = make_daemon("sandbox:\n  docker_host: unix:///nonexistent/docker.sock\n")
    with daemon.client() as client:
        with pytest.raises(RpcError) as info:
            call(client, "hello", {"name": "x"})
        assert info.value.code == -32002
        assert "Docker engine" in info.value.message
        assert client.request("sandbox/status")["backend"] == "docker"


# -- the sandbox's environment --------------------------------------------------------


def test_env_and_mounts_as_the_spec_says(daemon: Daemon) -> None:
    (daemon.user_dir(A)).mkdir(parents=True, exist_ok=True)
    with daemon.client() as client:
        probe = call(client, "env_probe", env={"OFFICER_RESOURCES": '{"ocr": {}}', "PI_SEARXNG_URL": "http://127.0.0.1:1"})
        details = probe["details"]
        assert details["env"]["HOME"] == "/officer/user" == details["env"]["OFFICER_USER_HOME"]
        assert details["env"]["OFFICER_USER_ROOT"] == "/officer/user"
        assert details["env"]["PI_TOOLS_DIRS"] == "/officer/tools:/officer/user/tools"
        assert details["env"]["OFFICER_EMAIL_DB"] == "/officer/data/emails.db"
        assert details["env"]["OFFICER_RESOURCES"] == '{"ocr": {}}'
        assert details["uid"] != 0
        # Per-call env is gone at the next call.
        assert call(client, "env_probe")["details"]["env"].get("OFFICER_RESOURCES") is None

        report = call(client, "fs_probe", {
            "write": "/officer/tools/x,/officer/user/tools/x,/officer/user/note.txt,/etc/x,/tmp/x,/officer/data/x",
        })["details"]
        assert report["write /officer/tools/x"] in READ_ONLY_REFUSALS
        assert report["write /officer/user/tools/x"] in READ_ONLY_REFUSALS
        assert report["write /officer/user/note.txt"] == "ok"
        assert report["write /etc/x"] in ("EROFS", "EACCES")
        assert report["write /tmp/x"] == "ok"
    assert (daemon.user_dir(A) / "note.txt").read_text() == "probe"


def test_users_cannot_see_each_other(daemon: Daemon) -> None:
    secret = daemon.user_dir(A) / "secret.txt"
    secret.parent.mkdir(parents=True, exist_ok=True)
    secret.write_text("alice's secret")
    with daemon.client() as client:
        mine = call(client, "fs_probe", {"read": "/officer/user/secret.txt"}, user=A)["details"]
        assert mine["read /officer/user/secret.txt"] == "ok:alice's secret"
        theirs = call(client, "fs_probe", {"read": f"/officer/user/secret.txt,/officer/user,/officer/{A},/officer"}, user=B)["details"]
        assert theirs["read /officer/user/secret.txt"] == "ENOENT"
        assert "alice's secret" not in json.dumps(theirs)
        assert theirs["read /officer/user"] == "ok:tools"  # bob's own, empty but for tools/


def test_env_values_never_reach_the_log(daemon: Daemon) -> None:
    token = "apify-token-d41d8cd98f00"
    with daemon.client() as client:
        call(client, "env_probe", env={"OFFICER_APIFY_TOKEN": token})
    daemon.stop()
    assert token not in daemon.log()


# -- deadlines and cancellation ------------------------------------------------------


def test_timeout_replaces_the_sandbox_and_next_call_is_served(make_daemon: Any) -> None:
    daemon = make_daemon("pool:\n  min_idle: 0\n")
    with daemon.client() as client:
        first = call(client, "env_probe")
        result = call(client, "sleeper", {"ms": 60000}, timeoutMs=500)
        assert result["status"] == "timeout" and result["isError"] is True
        # Bounds far from both ends: the deadline held, and the sleep did not run out.
        assert 400 <= result["durationMs"] < 20000
        again = call(client, "env_probe")
        assert again["status"] == "ok"
        assert client.request("sandbox/status")["pool"]["counters"]["destroyed"] >= 1
        assert first["details"] is not None


def test_cancel_reaches_the_tools_signal(daemon: Daemon) -> None:
    with daemon.client() as client:
        call(client, "hello", {"name": "warm"})
        start_running(client, 7, "announcer", {"ms": 60000})
        client.cancel(7, "user pressed stop")
        client.cancel(999, "unknown ids are ignored")
        reply = client.read_message()
        result = reply["result"]
        assert reply["id"] == 7 and result["status"] == "cancelled" and result["isError"] is True
        assert result["details"]["aborted"] is True
        assert "user pressed stop" in result["details"]["reason"]
        assert result["durationMs"] < 20000  # the abort, not the 60 s sleep, ended it
        assert call(client, "hello", {"name": "after"})["status"] == "ok"


def test_tool_ignoring_abort_is_killed_after_grace(make_daemon: Any) -> None:
    daemon = make_daemon("calls:\n  cancel_grace_ms: 500\n")
    with daemon.client() as client:
        start_running(client, 1, "stubborn", {})
        started = time.monotonic()
        client.cancel(1)
        result = client.read_message()["result"]
        assert result["status"] == "cancelled"
        assert "killed" in result["content"][0]["text"]
        assert time.monotonic() - started < 20  # killed after the grace; it would spin forever
        assert call(client, "hello", {"name": "next"})["status"] == "ok"


def test_disconnect_frees_the_sandbox(make_daemon: Any) -> None:
    daemon = make_daemon("pool:\n  max_per_user: 1\n  min_idle: 0\n  acquire_timeout_ms: 5000\n")
    leaving = daemon.client()
    start_running(leaving, 1, "announcer", {"ms": 60000})  # alice's one sandbox is taken
    leaving.close()
    with daemon.client() as client:
        started = time.monotonic()
        assert call(client, "hello", {"name": "x"})["status"] == "ok"
        assert time.monotonic() - started < 20  # not behind the 60 s sleep of the one who left


# -- transports --------------------------------------------------------------------------


@pytest.mark.parametrize("transport", ["socket", "attach"])
def test_each_transport_serves_results_progress_crashes_and_timeouts(make_daemon: Any, transport: str) -> None:
    daemon = make_daemon(f"sandbox:\n  transport: {transport}\n  memory: 96m\npool:\n  min_idle: 0\n")
    with daemon.client() as client:
        assert call(client, "hello", {"name": transport})["content"][0]["text"] == f"Hello, {transport}!"
        steps: list[str] = []
        client.request("tools/call", {"user": A, "name": "progress", "arguments": {"steps": 3}},
                       on_progress=lambda p: steps.append(p["content"][0]["text"]))
        assert steps == ["step 1", "step 2", "step 3"]
        assert call(client, "thrower")["status"] == "error"
        exited = call(client, "exiter", {"code": 3})
        assert exited["status"] == "crashed" and "code 3" in exited["content"][0]["text"]
        hog = call(client, "memory_hog", timeoutMs=60000)
        assert hog["status"] == "crashed" and "96m" in hog["content"][0]["text"]
        assert call(client, "sleeper", {"ms": 60000}, timeoutMs=500)["status"] == "timeout"
        assert call(client, "hello", {"name": "again"})["status"] == "ok"
        assert client.request("sandbox/status")["transport"] == transport


def test_the_shim_socket_is_gone_once_the_shim_connected(make_daemon: Any, docker_api: Any) -> None:
    daemon = make_daemon(start=False)
    shims = daemon.socket.parent / f"{daemon.socket.name}.shims"
    (shims / "left-by-a-killed-run").mkdir(parents=True)
    daemon.start()
    with daemon.client() as client:
        assert call(client, "hello", {"name": "x"})["status"] == "ok"
        deadline = time.monotonic() + 20  # the warm spare is started after the call
        while client.request("sandbox/status")["pool"]["totals"]["idle"] < 2 and time.monotonic() < deadline:
            time.sleep(0.1)
    assert shims.stat().st_mode & 0o777 == 0o700  # on the host, only the daemon's user gets in
    # An earlier run's leftovers are gone, and each sandbox's shim socket once used: only the
    # egress proxy's socket stays (and the sandbox's /etc/hosts), one directory per running sandbox.
    containers = daemon.containers(docker_api)
    assert len(list(shims.iterdir())) == len(containers) == 2
    assert all(sorted(p.name for p in d.iterdir()) == ["egress.sock", "hosts"] for d in shims.iterdir())
    for container in containers:
        listing = subprocess.run(["docker", "exec", container["Id"], "ls", "-A", "/officer/run"],
                                 capture_output=True, text=True, timeout=30)
        assert listing.returncode == 0 and listing.stdout == "egress.sock\nhosts\n", listing  # no shim socket to take
    daemon.stop()
    assert list(shims.iterdir()) == []  # each removed with its sandbox


def test_socket_transport_with_a_remote_engine_is_refused_at_start_up(make_daemon: Any) -> None:
    daemon = make_daemon("sandbox:\n  docker_host: tcp://127.0.0.1:2375\n", start=False)
    result = subprocess.run([sys.executable, "-m", "sandboxd", "serve", "--config", str(daemon.config_path)],
                            capture_output=True, text=True, timeout=60, env=daemon.env)
    assert result.returncode != 0
    assert "sandbox.transport: attach" in result.stderr


# -- lifecycle ---------------------------------------------------------------------------


def test_shutdown_leaves_no_container(make_daemon: Any, docker_api: Any) -> None:
    daemon = make_daemon()
    with daemon.client() as client:
        call(client, "hello", {"name": "x"})
        call(client, "hello", {"name": "y"}, user=B)
    assert daemon.containers(docker_api)
    assert daemon.stop(signal.SIGTERM) == 0
    assert daemon.containers(docker_api) == []
    assert not daemon.socket.exists()


def test_shutdown_lets_calls_in_flight_finish(make_daemon: Any) -> None:
    daemon = make_daemon()
    results: list[dict[str, Any]] = []
    client = daemon.client()
    call(client, "hello", {"name": "warm"})

    running = threading.Event()

    def slow() -> None:
        results.append(client.request("tools/call", {"user": A, "name": "announcer", "arguments": {"ms": 1500}},
                                      on_progress=lambda _: running.set()))

    thread = threading.Thread(target=slow)
    thread.start()
    assert running.wait(30), "the call did not start"
    daemon.proc.send_signal(signal.SIGTERM)
    thread.join(20)
    assert results and results[0]["status"] == "ok"
    assert daemon.stop() == 0


def test_sigkill_leaves_orphans_that_the_next_start_removes(make_daemon: Any, docker_api: Any) -> None:
    daemon = make_daemon()
    with daemon.client() as client:
        call(client, "hello", {"name": "x"})
    daemon.stop(signal.SIGKILL)
    assert daemon.containers(docker_api), "a SIGKILLed daemon cannot clean up"
    daemon.start()
    # A removal the engine did not finish at start is retried each maintenance tick; under gVisor on
    # this 2-core machine one clean run saw an orphan outlive 10 s (the next two runs passed).
    deadline = time.monotonic() + 30
    while daemon.containers(docker_api) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert daemon.containers(docker_api) == []
    with daemon.client() as client:
        assert call(client, "hello", {"name": "back"})["status"] == "ok"


def test_socket_is_0660(daemon: Daemon) -> None:
    assert daemon.socket.stat().st_mode & 0o777 == 0o660


def test_email_db_is_mounted_read_write_when_it_exists(daemon: Daemon) -> None:
    # Where sandbox.email_db puts it by default: outside the user's data folder (test_isolation_mounts.py).
    db = daemon.data / "email" / A / "emails.db"
    db.parent.mkdir(parents=True, exist_ok=True)
    subprocess.run(["python3", "-c", f"import sqlite3; c = sqlite3.connect({str(db)!r}); "
                    "c.execute('create table m (s text)'); c.execute(\"insert into m values ('hi')\"); c.commit()"],
                   check=True)
    assert db.stat().st_mode & 0o002 == 0  # the sandbox uid writes by the ACL sandboxd sets, not by the mode
    write_tool(daemon.data / "tools", "email_count", """
import { execFileSync } from 'node:child_process';
export async function execute() {
  const db = process.env.OFFICER_EMAIL_DB!;
  execFileSync('sqlite3', [db, "insert into m values ('from the sandbox')"]);
  const n = execFileSync('sqlite3', [db, 'select count(*) from m'], { encoding: 'utf-8' }).trim();
  return { content: [{ type: 'text', text: n }] };
}
""")
    with daemon.client() as client:
        result = call(client, "email_count")
        assert result["status"] == "ok", result
        assert result["content"][0]["text"] == "2"
        # No database for bob: the path is simply absent.
        report = call(client, "fs_probe", {"read": "/officer/data/emails.db"}, user=B)["details"]
        assert report["read /officer/data/emails.db"] == "ENOENT"
    import sqlite3

    rows = sqlite3.connect(db).execute("select s from m").fetchall()
    assert ("from the sandbox",) in rows


def test_cli_ctrl_c_cancels_the_call(daemon: Daemon) -> None:
    proc = subprocess.Popen(
        [sys.executable, "-m", "sandboxd", "call", "--socket", str(daemon.socket), "--user", A, "announcer", "--arg", "ms=30000"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO,
    )
    assert proc.stderr is not None
    assert proc.stderr.readline() == "… running\n"  # the CLI printed the tool's first progress: it runs
    proc.send_signal(signal.SIGINT)
    try:
        out, err = proc.communicate(timeout=30)
    except subprocess.TimeoutExpired:
        # Seen once under gVisor in a full run, never alone: what each side did is the only lead.
        proc.kill()
        out, err = proc.communicate()
        raise AssertionError(f"no answer within 30 s of Ctrl-C\nCLI stdout: {out}\nCLI stderr: {err}\n"
                             f"daemon log:\n{daemon.log()}") from None
    assert proc.returncode == 1, err
    assert "aborted: " in out and "cancelled with Ctrl-C" in out
    assert "status cancelled" in err


def test_the_machines_sandboxd_variables_do_not_reach_the_test_daemon(make_daemon: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    # With SANDBOXD_BACKEND=process inherited, most of this file would pass on the process backend.
    monkeypatch.setenv("SANDBOXD_BACKEND", "process")
    monkeypatch.setenv("SANDBOXD_POOL_MAX_PER_USER", "1")
    daemon = make_daemon()
    with daemon.client() as client:
        status = client.request("sandbox/status")
    assert status["backend"] == "docker" and status["unsandboxed"] is False
    assert status["limits"]["maxPerUser"] == 4
