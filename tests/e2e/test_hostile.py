"""The hostile-tool catalogue, end to end: real daemon, real Docker, real tools.

Every tool in tests/e2e/hostile/ attacks as its own user ("mallory.<test>"). Each
test asserts the status the attacker gets, that bystanders (alice, bob) and the
attacker's own next call are still served, and that the pool settles back with
Docker holding exactly the sandboxes the pool knows about. The module's daemon
checks at teardown that no container is left behind.
"""

from __future__ import annotations

import json
import subprocess
import threading
import time
import uuid
from pathlib import Path
from typing import Any, Iterator

import pytest

from sandboxd.client import Client

from tests.e2e.conftest import GVISOR, READ_ONLY_REFUSALS, Daemon, write_tool
from tests.e2e.hostile_harness import (
    BYSTANDER_A,
    BYSTANDER_B,
    MEMORY_LIMIT,
    PIDS_LIMIT,
    Background,
    assert_bystanders_served,
    assert_pool_recovers,
    containers_running,
    call,
    host_processes,
    module_daemon,
    text_of,
    wait_until,
)

pytestmark = pytest.mark.docker

CANARY = f"canary-{uuid.uuid4().hex}"  # a secret in the daemon's environment that no tool may see


@pytest.fixture(scope="module")
def hostile(tmp_path_factory: pytest.TempPathFactory, docker_api: Any) -> Iterator[Daemon]:
    with module_daemon(tmp_path_factory.mktemp("hostile"), docker_api, env={"HOSTILE_CANARY_SECRET": CANARY}) as daemon:
        yield daemon


@pytest.fixture
def attacker(request: pytest.FixtureRequest) -> str:
    return f"mallory.{request.node.name.split('[')[0].removeprefix('test_')[:40].replace('_', '-')}@example.com"


def daemon_rss_kb(daemon: Daemon) -> int:
    assert daemon.proc is not None
    status = Path(f"/proc/{daemon.proc.pid}/status").read_text()
    return int(status.split("VmRSS:")[1].split()[0])


def start_call(client: Client, request_id: Any, user: str, name: str, arguments: dict[str, Any] | None = None, **extra: Any) -> None:
    client.send({"jsonrpc": "2.0", "id": request_id, "method": "tools/call",
                 "params": {"user": user, "name": name, "arguments": arguments or {}, **extra}})


def wait_running(client: Client, request_id: Any) -> None:
    """Until the call's first progress update: the tool runs (no guess by the clock)."""
    while True:
        message = client.read_message()
        assert message.get("id") != request_id, f"the call answered before it said it runs: {message}"
        if message.get("method") == "notifications/progress" and message["params"]["progressToken"] == request_id:
            return


def answer_to(client: Client, request_id: Any) -> dict[str, Any]:
    while True:
        message = client.read_message()
        if message.get("id") == request_id:
            assert "result" in message, message
            return message["result"]


# -- CPU, memory, processes ---------------------------------------------------------------


def test_cpu_spin_ignoring_abort_is_killed_after_the_grace(hostile: Daemon, docker_api: Any, attacker: str) -> None:
    with hostile.client(timeout=60) as client:
        start_call(client, "spin", attacker, "cpu_spin")
        wait_running(client, "spin")
        # While it spins: the attacker's own next call (another sandbox) and other users are served.
        assert_bystanders_served(hostile, (attacker, BYSTANDER_A, BYSTANDER_B))
        client.cancel("spin", "user pressed stop")
        result = answer_to(client, "spin")
        assert result["status"] == "cancelled" and result["isError"] is True
        assert "did not stop within 0.5 s" in text_of(result) and "killed" in text_of(result)
        # The same spin without a cancel runs into its deadline.
        timed_out = call(client, attacker, "cpu_spin", timeoutMs=1500)
        assert timed_out["status"] == "timeout" and "1.5 s" in text_of(timed_out)
    assert_pool_recovers(hostile, docker_api, attacker)
    assert_bystanders_served(hostile, (attacker,))


def test_memory_bomb_crashes_naming_the_limit(hostile: Daemon, docker_api: Any, attacker: str) -> None:
    with hostile.client() as client:
        result = call(client, attacker, "memory_bomb")
    assert result["status"] == "crashed" and result["isError"] is True
    assert "out of memory" in text_of(result) and MEMORY_LIMIT in text_of(result)
    assert_pool_recovers(hostile, docker_api, attacker)
    assert_bystanders_served(hostile, (attacker, BYSTANDER_A, BYSTANDER_B))


def test_fork_bomb_is_stopped_by_the_pids_limit(hostile: Daemon, docker_api: Any, attacker: str) -> None:
    with hostile.client() as client:
        result = call(client, attacker, "fork_bomb", timeoutMs=15000)
        if GVISOR:
            # The pids limit counts gVisor's own host threads (one per sandbox thread, on ptrace):
            # at the limit the Sentry cannot make its next one and stops the whole sandbox (exit
            # code 2). The same verdict, shown otherwise: the bomb ends with its sandbox.
            assert result["status"] == "crashed" and "exited with code 2" in text_of(result), result
            assert_bystanders_served(hostile)
            probe = call(client, attacker, "escalator")
            assert probe["status"] == "ok", probe
            assert_pool_recovers(hostile, docker_api, attacker)
            return
        # What the pids limit produces, and nothing else would: fork fails with EAGAIN while the
        # tool holds fewer processes than the limit (96: the bomb's shells and the shim hold the rest).
        # Without the limit the tool would hold all 100,000 sleeps, or the memory limit would kill it.
        assert result["status"] == "error", result
        assert text_of(result) == "fork failed: EAGAIN", result
        held, bombed = result["details"]["held"], result["details"]["sandbox"]
        assert held < PIDS_LIMIT, result["details"]  # 0 when the bomb's shells took every pid first
        assert_bystanders_served(hostile)
        # The bombed sandbox is retired (processes left), never reused: its container goes.
        wait_until(lambda: not any(c["Id"].startswith(bombed) for c in hostile.containers(docker_api)), 20,
                   f"the bombed sandbox {bombed} to be removed")
        assert hostile.events("sandbox_retired", sandbox=bombed), "the bombed sandbox was not retired"
        # The attacker's next sandbox can start processes again.
        probe = call(client, attacker, "escalator")
    assert probe["status"] == "ok"
    assert not probe["details"]["su root"].startswith("error:"), probe["details"]
    assert_pool_recovers(hostile, docker_api, attacker)


def test_processes_outliving_a_timeout_die_with_the_sandbox(hostile: Daemon, docker_api: Any, attacker: str) -> None:
    marker = f"leak{uuid.uuid4().hex[:12]}"
    with hostile.client(timeout=60) as client:
        start_call(client, "leak", attacker, "process_leaker", {"marker": marker}, timeoutMs=4000)
        if GVISOR:  # its processes live in gVisor's kernel, not the host's: the host's ps cannot see them
            result = answer_to(client, "leak")
            assert result["status"] == "timeout"
            assert_pool_recovers(hostile, docker_api, attacker)
            return
        # Both the child and the setsid'd grandchild run, in the sandbox, visible from the host.
        found = wait_until(lambda: len(host_processes(marker)) >= 2 and host_processes(marker), 10, "the leaked processes")
        assert any(f"{marker}-child" in p for p in found) and any(f"{marker}-grandchild" in p for p in found), found
        sandboxes = containers_running(hostile, docker_api, attacker, marker)
        assert len(sandboxes) == 1, sandboxes
        result = answer_to(client, "leak")
    assert result["status"] == "timeout"
    # The timed-out sandbox is destroyed, and every process in it with it.
    wait_until(lambda: not host_processes(marker), 15, f"processes marked {marker} to be gone")
    wait_until(lambda: sandboxes[0] not in {c["Id"] for c in hostile.containers(docker_api)}, 15,
               "the timed-out sandbox's container to be removed")
    assert_pool_recovers(hostile, docker_api, attacker)
    assert_bystanders_served(hostile, (attacker,))


def test_processes_left_behind_by_a_returning_call_retire_the_sandbox(hostile: Daemon, docker_api: Any, attacker: str) -> None:
    marker = f"leftover{uuid.uuid4().hex[:12]}"
    with hostile.client() as client:
        result = call(client, attacker, "process_leaker", {"marker": marker, "hang": False})
    assert result["status"] == "ok", result
    # The shim reported the leftovers; the daemon did not reuse the sandbox but destroyed it.
    wait_until(lambda: not host_processes(marker), 15, f"processes marked {marker} to be gone")
    assert hostile.events("sandbox_retired", sandbox=result["details"]["sandbox"])
    assert_pool_recovers(hostile, docker_api, attacker)


# -- disks and output ---------------------------------------------------------------------


def test_filling_tmp_is_enospc_and_the_next_call_gets_a_fresh_tmp(hostile: Daemon, docker_api: Any, attacker: str) -> None:
    with hostile.client() as client:
        first = call(client, attacker, "disk_filler", {"path": "/tmp/fill"})
        assert first["status"] == "error" and text_of(first).startswith("ENOSPC")
        assert "after 16777216 bytes" in text_of(first)  # sandbox.tmp_size: 16m
        assert_bystanders_served(hostile)
        # A full /tmp retires the sandbox: the next call starts with an empty one.
        second = call(client, attacker, "disk_filler", {"path": "/tmp/fill2"})
        assert "after 16777216 bytes" in text_of(second), second
    assert_pool_recovers(hostile, docker_api, attacker)


def test_filling_the_user_directory_is_enospc_for_that_user_only(hostile: Daemon, docker_api: Any, attacker: str) -> None:
    # The host disk cannot be filled in a test: give this user a 20 MB data directory.
    user_dir = hostile.user_dir(attacker)
    user_dir.mkdir(parents=True, exist_ok=True)
    mount = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=20m", "tmpfs", str(user_dir)], capture_output=True, text=True)
    if mount.returncode != 0:
        # Not a skip: without the small filesystem this defence is unproven, which is a failure to see.
        pytest.fail(f"cannot mount a 20 MB tmpfs on {user_dir} ({mount.stderr.strip()}): this test needs root "
                    "(CAP_SYS_ADMIN) on the Docker engine's host; run it as root there, or deselect it by name")
    try:
        with hostile.client() as client:
            result = call(client, attacker, "disk_filler", {"path": "/officer/user/fill"})
            assert result["status"] == "error" and text_of(result).startswith("ENOSPC"), result
            written = (user_dir / "fill").stat().st_size
            assert 15 << 20 < written <= 20 << 20
            # Other users write to their own data directories as usual.
            other = call(client, BYSTANDER_A, "fs_probe", {"write": "/officer/user/unaffected.txt"})
            assert other["details"]["write /officer/user/unaffected.txt"] == "ok"
            assert (hostile.user_dir(BYSTANDER_A) / "unaffected.txt").read_text() == "probe"
        assert_pool_recovers(hostile, docker_api, attacker)
    finally:
        subprocess.run(["umount", "-l", str(user_dir)], check=False)


@pytest.mark.parametrize("stream", ["stdout", "stderr"])
def test_an_output_flood_is_throttled_with_bounded_daemon_memory(hostile: Daemon, docker_api: Any, attacker: str, stream: str) -> None:
    # Decision (docs/security.md): tool output is read and dropped but for a 20-line tail, at
    # calls.output_rate_bytes (4 MiB/s here, after a 1 MiB burst): past it sandboxd stops reading
    # and the tool blocks on its full pipe. 24 MiB then take at least (24 - 1 - what the pipes
    # hold, a few MiB at most) / 4 s: far above 3 s; unthrottled they take a fraction of a second.
    before = daemon_rss_kb(hostile)
    log_from = hostile.log_path.stat().st_size
    # Sampled all along, not read after: a daemon that buffered the flood and freed it would pass that.
    peak, done = [before], threading.Event()

    def sample() -> None:
        while not done.is_set():
            peak.append(daemon_rss_kb(hostile))
            time.sleep(0.02)

    sampler = threading.Thread(target=sample, daemon=True)
    flood = Background(hostile, attacker, "output_flood", {"stream": stream, "mb": 24}, timeoutMs=60000)
    sampler.start()
    assert_bystanders_served(hostile)
    result = flood.join()
    done.set()
    sampler.join(5)
    assert result["status"] == "ok" and text_of(result) == f"printed 24 MiB to {stream}", result
    if not GVISOR:  # gVisor's kernel takes the sandbox's output into its own memory (within the sandbox's
        # limit) and hands it on at the daemon's pace: the tool's writes return at once, the daemon's
        # reading is throttled just the same (its memory, below, is what this defence is for).
        assert result["details"]["writeMs"] >= 3000, f"the tool was not slowed down: {result['details']}"
    # (Under gVisor the call returns within a few samples: its kernel holds the flood, not the daemon.)
    assert (GVISOR or len(peak) > 10) and max(peak) - before < 48 * 1024, "the daemon's memory grew with the tool's output"
    status = assert_pool_recovers(hostile, docker_api, attacker)
    # What was still in the pipes when it returned is within the idle allowance: not broken.
    with hostile.client() as client:
        assert call(client, attacker, "hello", {"name": "after"})["status"] == "ok"
    with hostile.log_path.open("rb") as log:
        log.seek(log_from)
        # Under gVisor its kernel may still hold much of the flood when the call returns: past the
        # idle allowance the sandbox is stopped as broken and replaced (the hello above was served).
        assert GVISOR or b"sandbox_broken" not in log.read(), status


def test_a_50_mb_result_is_cut_with_a_note(hostile: Daemon, docker_api: Any, attacker: str) -> None:
    with hostile.client() as client:
        result = call(client, attacker, "huge_result", {"mb": 50})
    assert result["status"] == "ok"
    blocks = result["content"]
    assert blocks[-1]["text"].startswith("[result cut at 1048576 bytes by sandboxd")  # calls.max_result_bytes
    assert set(blocks[0]["text"]) == {"y"} and 1_000_000 < len(blocks[0]["text"]) < 1 << 20
    assert "second block" not in json.dumps(result)
    assert len(json.dumps(result)) < (1 << 20) + 1024
    assert_pool_recovers(hostile, docker_api, attacker)


@pytest.mark.parametrize(("what", "fragment"), [
    ("garbage", "not the shim protocol"),
    ("endless_line", "exceeded"),  # the daemon's own line limit, for a tool that bypasses the shim
])
def test_a_tool_writing_to_the_protocol_fd_crashes_only_its_sandbox(hostile: Daemon, docker_api: Any, attacker: str,
                                                                     what: str, fragment: str) -> None:
    with hostile.client() as client:
        result = call(client, attacker, "protocol_forger", {"what": what})
    assert result["status"] == "crashed" and fragment in text_of(result), result
    assert_pool_recovers(hostile, docker_api, attacker)
    assert_bystanders_served(hostile, (attacker, BYSTANDER_A))


def test_the_containers_stdout_is_not_the_protocol_over_the_socket(hostile: Daemon, attacker: str) -> None:
    with hostile.client() as client:
        result = call(client, attacker, "protocol_forger", {"what": "init_stdout"})
        assert result["status"] == "ok", result  # read as tool output, not as a protocol line
        assert call(client, attacker, "hello", {"name": "next"})["status"] == "ok"


# -- results and exits ------------------------------------------------------------------------


@pytest.mark.parametrize(("kind", "fragment"), [("bigint", "BigInt"), ("circular", "circular")])
def test_unserializable_results_are_errors(hostile: Daemon, docker_api: Any, attacker: str, kind: str, fragment: str) -> None:
    with hostile.client() as client:
        result = call(client, attacker, "unserializable", {"kind": kind})
        assert result["status"] == "error"
        assert "cannot be sent as JSON" in text_of(result) and fragment in text_of(result)
        assert call(client, attacker, "hello", {"name": "next"})["status"] == "ok"


@pytest.mark.parametrize(("tool", "arguments", "fragment"), [
    ("exit_midcall", {}, "exit code 0"),
    ("self_kill", {}, "SIGKILL"),
    ("protocol_forger", {"what": "close"}, "exit code 0"),
])
def test_a_sandbox_that_dies_mid_call_is_crashed_and_replaced(hostile: Daemon, docker_api: Any, attacker: str,
                                                              tool: str, arguments: dict[str, Any], fragment: str) -> None:
    with hostile.client() as client:
        result = call(client, attacker, tool, arguments)
    assert result["status"] == "crashed" and result["isError"] is True
    assert fragment in text_of(result), result
    assert_pool_recovers(hostile, docker_api, attacker)
    assert_bystanders_served(hostile, (attacker,))


def test_closing_stdout_is_harmless(hostile: Daemon, attacker: str) -> None:
    with hostile.client() as client:
        result = call(client, attacker, "stdout_closer")
        assert result["status"] == "ok" and text_of(result) == "still here"
        assert call(client, attacker, "hello", {"name": "next"})["status"] == "ok"


def test_resolving_long_after_the_abort(hostile: Daemon, docker_api: Any, attacker: str) -> None:
    with hostile.client(timeout=60) as client:
        start_call(client, "late", attacker, "late_resolver", {"ms": 4000})
        wait_running(client, "late")
        client.cancel("late", "stop")
        result = answer_to(client, "late")
        assert result["status"] == "cancelled" and "killed" in text_of(result)
        # Past the deadline instead: answered at the deadline; the late resolution goes nowhere.
        timed_out = call(client, attacker, "late_resolver", {"ms": 3000}, timeoutMs=800)
        assert timed_out["status"] == "timeout"
        assert call(client, attacker, "hello", {"name": "next"})["content"][0]["text"] == "Hello, next!"
        time.sleep(2.5)
        # Nothing stray arrived on this connection meanwhile: the very next line is the ping's
        # answer (Client.request would skip a line with another id).
        client.send({"jsonrpc": "2.0", "id": "after", "method": "ping"})
        assert client.read_message() == {"jsonrpc": "2.0", "id": "after", "result": {}}
    assert_pool_recovers(hostile, docker_api, attacker)


def test_an_unhandled_rejection_after_returning_fails_nobody(hostile: Daemon, docker_api: Any, attacker: str) -> None:
    with hostile.client() as client:
        first = call(client, attacker, "late_rejection", {"ms": 300})
        assert first["status"] == "ok"
        # Both of the attacker's sandboxes are busy while the rejection and the throw land
        # (max_per_user 2), so one of these calls runs where they happen: neither may fail.
        a = Background(hostile, attacker, "late_resolver", {"ms": 1200})
        b = Background(hostile, attacker, "late_resolver", {"ms": 1200})
        answers = [a.join(), b.join()]
    assert [answer["status"] for answer in answers] == ["ok", "ok"], answers
    assert first["details"]["sandbox"] in {answer["details"]["sandbox"] for answer in answers}, \
        "neither call ran in the sandbox where the stray errors landed"
    assert_pool_recovers(hostile, docker_api, attacker)


def test_a_timer_keeping_the_event_loop_alive(hostile: Daemon, docker_api: Any, attacker: str) -> None:
    with hostile.client() as client:
        first = call(client, attacker, "timer_keeper")
        assert first["status"] == "ok"
        time.sleep(0.3)
        second = call(client, attacker, "timer_keeper")
        assert second["status"] == "ok"
    # The same sandbox served both (a live timer does not retire it), and the timer kept running there.
    assert second["details"]["sandbox"] == first["details"]["sandbox"]
    assert second["details"]["ticks"] > first["details"]["ticks"]
    assert_pool_recovers(hostile, docker_api, attacker)


# -- ways out -----------------------------------------------------------------------------------


def test_tool_mounts_are_read_only(hostile: Daemon, attacker: str) -> None:
    own = write_tool(hostile.user_dir(attacker) / "tools", "aaa_own_tool",
                     "export async function execute() { return { content: [] }; }")
    global_tools = sorted(p for p in (hostile.data / "tools").iterdir() if p.is_dir())
    before = {p: (p / "index.ts").read_bytes() for p in (own, global_tools[0])}
    for tool in before:
        (tool / "index.ts").chmod(0o666)  # so that only a read-only mount can refuse the append (not EACCES)
    with hostile.client() as client:
        report = call(client, attacker, "ro_writer")["details"]
    assert "append /officer/user/tools/aaa_own_tool/index.ts" in report
    assert f"append /officer/tools/{global_tools[0].name}/index.ts" in report
    assert len(report) == 14
    # The image's own files are root's: refused either way. Everything else only by read-only
    # mounts (the tools folders) and the read-only root (/var/tmp is world-writable in the image).
    assert report.pop("write /opt/sandboxd/shim/src/main.js") in ("EACCES", "EROFS")
    for attempt, outcome in report.items():
        assert outcome in READ_ONLY_REFUSALS, f"{attempt}: {outcome}"
    assert {p: (p / "index.ts").read_bytes() for p in before} == before
    assert not (hostile.user_dir(attacker) / "tools" / "evil.ts").exists()


def test_no_secrets_other_users_or_docker_socket_in_reach(hostile: Daemon, attacker: str) -> None:
    secret = hostile.user_dir(BYSTANDER_A) / "diary.txt"
    secret.parent.mkdir(parents=True, exist_ok=True)
    secret.write_text("alice's diary")
    with hostile.client() as client:
        call(client, BYSTANDER_A, "env_probe", env={"OFFICER_APIFY_TOKEN": "alice-token-123"})
        report = call(client, attacker, "snooper", {"victim": BYSTANDER_A})["details"]
    # It really looked: at alice's host path (from its own mount's source) and next door.
    victim_path = report.pop("victim host path")
    # gVisor's mountinfo does not show its mounts' host paths at all: there was nothing to learn.
    assert victim_path == ("/" if GVISOR else str(secret.parent.resolve())), victim_path
    tries = {key: report.pop(key) for key in list(report) if key.startswith("victim ")}
    if GVISOR:  # with no host path learnt, its "victim /" is the sandbox's own root: nothing of alice's
        assert "diary" not in tries.pop("victim /") and len(tries) == 5
        tries["victim /"] = "ENOENT"
    refusals = ("ENOENT", "EACCES") if GVISOR else ("ENOENT",)  # gVisor: /proc/1/root is not the sandbox's to read
    assert len(tries) == 6 and all(outcome in refusals for outcome in tries.values()), tries
    assert report["ls /officer/user"].startswith("dir:") and "diary.txt" not in report["ls /officer/user"]
    everything = json.dumps(report)
    assert CANARY not in everything, "the daemon's environment leaked into a sandbox"
    # (/proc/self/mountinfo does show the host paths of the sandbox's own mounts: accepted, docs/security.md.)
    for leak in ("alice's diary", "alice-token-123", BYSTANDER_A, BYSTANDER_B):
        assert leak not in everything, leak
    assert report["/var/run/docker.sock"] == "ENOENT" and report["/run/docker.sock"] == "ENOENT"
    assert "docker.sock" not in report["/run"] + report["/var/run"]
    assert report["/proc/1/root"] in ("EACCES", "EPERM", report["/"])  # init's root is the sandbox's own
    assert "officer" in report["/"]
    assert report["/root"] in ("EACCES", "ENOENT")
    assert report["/officer/user/.."] == report["/officer"] and attacker not in report["/officer"]


def test_no_privileges_to_gain_and_no_raw_sockets(hostile: Daemon, attacker: str) -> None:
    with hostile.client() as client:
        report = call(client, attacker, "escalator")["details"]
    assert report["uid"] != "0"
    if GVISOR:
        # gVisor's /proc reports neither: Docker's seccomp filter and no_new_privs hold its Sentry on
        # the host, and the tool's syscalls are gVisor's own kernel's to serve. What they would
        # prevent is still refused below.
        assert (report["NoNewPrivs"], report["Seccomp"]) == ("?", "0"), report
    else:
        assert report["NoNewPrivs"] == "1"
        assert report["Seccomp"] == "2"  # Docker's default seccomp filter is on
    assert report["CapEff"] == report["CapPrm"] == report["CapBnd"] == "0000000000000000"
    assert not report["su root"].startswith("exit:0"), report["su root"]
    assert not report["mount tmpfs"].startswith("exit:0"), report["mount tmpfs"]
    assert report["setuid(0)"] == "exit:0 EPERM"
    assert report["raw sockets"] == "exit:0 raw_icmp EPERM\nraw_tcp EPERM\npacket EPERM"
