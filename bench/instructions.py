"""Instructions per warm call: the daemon's cost in a unit the machine's noise does not move.

CPU µs per call move with whatever else runs (on a shared 2-core machine, by half between
runs); the instructions the daemon executes for the same calls do not. Here the daemon runs
under valgrind's callgrind (perf's counters are not exposed in most VMs): it is told to dump
its count just before and just after ``calls`` warm hello calls, and again after as many
seconds of quiet, so that what the idle daemon does meanwhile (timers, slowed ~50× under
valgrind) is taken out. Beside it, the same calls' CPU µs on a daemon not under valgrind.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

from bench.daemon import BenchDaemon, sequential_calls
from bench.load import daemon_call_line, process_cpu

# Under valgrind the daemon runs ~50× slower: a sandbox's start, and its first call, get the time they need.
# What it does per second rather than per call would be counted ~50× more per call, so: its calls' log lines
# are all over budget, as at the thousands of calls a second it serves unslowed (at 10 lines a second of a
# slowed 50 calls, the lines built were a fifth of the count), and no disk quota is measured (a walk of the
# user's folders a second while they call moved the count by 5% between runs).
SLOW_CONFIG = ("pool:\n  start_timeout_ms: 600000\n  acquire_timeout_ms: 600000\ncalls:\n  default_timeout_ms: 600000\n"
               "log_rate: 0.001\nlog_burst: 1\nstorage:\n  enforcement: 'off'\n")
_SUMMARY = re.compile(rb"^summary:\s+(\d+)", re.M)
_TRIGGER = re.compile(rb"^desc: Trigger: (.*)$", re.M)


def available() -> str | None:
    """Why instructions cannot be counted here, or None if they can."""
    missing = [tool for tool in ("valgrind", "callgrind_control") if shutil.which(tool) is None]
    return f"{' and '.join(missing)} not found: apt-get install valgrind" if missing else None


def _dumps(directory: Path) -> dict[str, int]:
    """Instructions of each callgrind dump in ``directory``, by its trigger ("dump <label>")."""
    out = {}
    for path in directory.glob("callgrind.out*"):
        data = path.read_bytes()
        trigger, summary = _TRIGGER.search(data), _SUMMARY.search(data)
        if trigger and summary:
            out[trigger.group(1).decode().removeprefix("dump ").strip()] = int(summary.group(1))
    return out


def _dump(pid: int, label: str) -> None:
    # callgrind_control reaches the process through vgdb; each dump also zeroes the counters.
    subprocess.run(["callgrind_control", "--dump=" + label, str(pid)], check=True, capture_output=True, timeout=120)


def count(root: Path, config_yaml: str, user: str, calls: int, warmup: int,
          say: Callable[[str], None] = lambda _: None) -> dict[str, Any]:
    """Instructions the daemon executes per warm hello call (idle cost taken out), under callgrind."""
    out_dir = Path(tempfile.mkdtemp(prefix="sbd-callgrind-"))
    daemon = BenchDaemon(root, config_yaml + SLOW_CONFIG, fresh_tools=0, command_prefix=[
        "valgrind", "--tool=callgrind", f"--callgrind-out-file={out_dir}/callgrind.out", "--dump-instr=no"],
        # A random hash seed lays out sets and dicts anew at each start, and moves the count by ~2%.
        environ={"PYTHONHASHSEED": "0"})
    try:
        say("  starting the daemon under callgrind (about a minute)")
        daemon.start(timeout=900)
        conn = daemon.connect()
        try:
            template = daemon_call_line(user)
            sequential_calls(conn, template, warmup)  # the sandbox starts, hello loads, every code path is warm
            daemon.settle(timeout=600)
            _dump(daemon.pid, "before")
            started = time.monotonic()
            sequential_calls(conn, template, calls, first_id=warmup + 1)
            window_s = time.monotonic() - started
            _dump(daemon.pid, "calls")
            time.sleep(window_s)
            _dump(daemon.pid, "idle")
        finally:
            conn.close()
    finally:
        daemon.stop(timeout=600)
        _remove_leftovers(daemon)
    counts = _dumps(out_dir)
    shutil.rmtree(out_dir, ignore_errors=True)
    if "calls" not in counts or "idle" not in counts:
        raise RuntimeError(f"callgrind wrote no dumps for the window (found {sorted(counts)}); is vgdb usable here?")
    return {"calls": calls, "instructions_per_call": (counts["calls"] - counts["idle"]) / calls,
            "idle_instructions_per_call": counts["idle"] / calls, "window_s": window_s}


def cpu_per_call(root: Path, config_yaml: str, user: str, calls: int, warmup: int) -> float:
    """The same calls' daemon CPU in µs per call, not under valgrind (moves with the machine's load)."""
    daemon = BenchDaemon(root, config_yaml, fresh_tools=0)
    daemon.start()
    try:
        conn = daemon.connect()
        try:
            template = daemon_call_line(user)
            sequential_calls(conn, template, warmup)
            daemon.settle()
            cpu0 = process_cpu(daemon.pid)
            sequential_calls(conn, template, calls, first_id=warmup + 1)
            return 1e6 * (process_cpu(daemon.pid) - cpu0) / calls
        finally:
            conn.close()
    finally:
        daemon.stop()
        _remove_leftovers(daemon)


def _remove_leftovers(daemon: BenchDaemon) -> None:
    """Sandboxes a daemon left behind (it removes its own when it stops; not after a crash)."""
    import docker

    from sandboxd.config import load_config
    from sandboxd.server.server import instance_id

    instance = instance_id(load_config(overrides={"socket": daemon.socket, "data_path": daemon.data}, environ={}))
    api = docker.APIClient(version="auto", timeout=120)
    for container in api.containers(all=True, filters={"label": f"org.sandboxd.instance={instance}"}):
        api.remove_container(container["Id"], force=True)


def per_call(root: Path, run_id: str, image: str, *, calls: int, cpu_calls: int, docker: bool,
             say: Callable[[str], None] = lambda _: None) -> dict[str, Any]:
    """Instructions and CPU µs per warm call on the fake backend (the daemon alone) and, with
    ``docker``, through a real sandbox."""
    out: dict[str, Any] = {}
    why = available()
    if why is not None:
        return {"skipped": why}
    paths = {"fake": "backend: fake\n"}
    if docker:
        paths["docker"] = f"sandbox:\n  image: {image}\n"
    for path, config in paths.items():
        user = f"instr-{path}-{run_id}@bench.example"
        say(f"instructions per warm call, {path} backend ({calls} calls under callgrind)")
        row = count(root / f"{path}-callgrind", config, user, calls, warmup=200, say=say)
        say(f"daemon CPU per warm call, {path} backend ({cpu_calls} calls)")
        row["daemon_cpu_us_per_call"] = cpu_per_call(root / f"{path}-cpu", config, user, cpu_calls, warmup=500)
        out[path] = row
    return out
