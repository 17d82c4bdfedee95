"""Instructions per warm call: the daemon's cost in a unit the machine's noise does not move.

CPU µs per call move with whatever else runs (on a shared 2-core machine, by half between
runs); the instructions the daemon executes for the same calls do not. Here the daemon runs
under valgrind's callgrind (bench/callgrind.py): it is told to dump its count just before and
just after ``calls`` warm hello calls, and again after as many seconds of quiet, so that what
the idle daemon does meanwhile (timers, slowed ~50× under valgrind) is taken out. Beside it,
the same calls' CPU µs on a daemon not under valgrind, and both figures of the daemon's floor:
a bare uvloop server answering the same calls, through Docker relaying them to a Node echo
(bench/cpu_floor.py).
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any, Callable

from bench import callgrind, cpu_floor
from bench.daemon import BenchDaemon, sequential_calls
from bench.load import daemon_call_line, process_cpu_split

# Under valgrind the daemon runs ~50× slower: a sandbox's start, and its first call, get the time they need.
# What it does per second rather than per call would be counted ~50× more per call, so: its calls' log lines
# are all over budget, as at the thousands of calls a second it serves unslowed (at 10 lines a second of a
# slowed 50 calls, the lines built were a fifth of the count), and no disk quota is measured (a walk of the
# user's folders a second while they call moved the count by 5% between runs).
SLOW_CONFIG = ("pool:\n  start_timeout_ms: 600000\n  acquire_timeout_ms: 600000\ncalls:\n  default_timeout_ms: 600000\n"
               "log_rate: 0.001\nlog_burst: 1\nstorage:\n  enforcement: 'off'\n")
# The daemon's CPU is measured in rounds alternating with the floor's, so that both share the machine's state:
# the floor's CPU per call alone moved 27-80 µs between runs minutes apart (a busy sibling core slows both).
CPU_ROUNDS = 5


def count(root: Path, config_yaml: str, user: str, calls: int, warmup: int,
          say: Callable[[str], None] = lambda _: None) -> dict[str, Any]:
    """Instructions the daemon executes per warm hello call (idle cost taken out), under callgrind."""
    out_dir = Path(tempfile.mkdtemp(prefix="sbd-callgrind-"))
    daemon = BenchDaemon(root, config_yaml + SLOW_CONFIG, fresh_tools=0, command_prefix=callgrind.callgrind_prefix(out_dir),
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
            window_s = callgrind.counted_window(
                daemon.pid, lambda: sequential_calls(conn, template, calls, first_id=warmup + 1))
        finally:
            conn.close()
    finally:
        daemon.stop(timeout=600)
        _remove_leftovers(daemon)
    return callgrind.per_call_counts(out_dir, calls, window_s)


def cpu_per_call(root: Path, config_yaml: str, user: str, calls: int, warmup: int,
                 floor: cpu_floor.CpuFloor | None = None) -> dict[str, Any]:
    """The same calls' daemon CPU in µs per call, not under valgrind (moves with the machine's load), in
    rounds alternating with ``floor``'s requests; with a floor, its CPU µs per call in those rounds too.
    Each beside its system part: the kernel's work for the process's reads, writes and waits."""
    daemon = BenchDaemon(root, config_yaml, fresh_tools=0)
    daemon.start()
    try:
        conn = daemon.connect()
        try:
            template = daemon_call_line(user)
            sequential_calls(conn, template, warmup)
            daemon.settle()
            chunk = max(1, calls // CPU_ROUNDS)
            daemon_user = daemon_system = floor_user = floor_system = 0.0
            floor_calls, next_id = 0, warmup + 1
            for _ in range(CPU_ROUNDS):
                if floor is not None:
                    requests = max(chunk, cpu_floor.MIN_CPU_REQUESTS // CPU_ROUNDS)
                    spent_user, spent_system = floor.cpu_seconds(requests)
                    floor_user, floor_system = floor_user + spent_user, floor_system + spent_system
                    floor_calls += requests
                user0, system0 = process_cpu_split(daemon.pid)
                sequential_calls(conn, template, chunk, first_id=next_id)
                user1, system1 = process_cpu_split(daemon.pid)
                daemon_user, daemon_system = daemon_user + user1 - user0, daemon_system + system1 - system0
                next_id += chunk
            calls_made = chunk * CPU_ROUNDS
            out = {"daemon_cpu_us_per_call": 1e6 * (daemon_user + daemon_system) / calls_made,
                   "daemon_system_us_per_call": 1e6 * daemon_system / calls_made}
            if floor is not None:
                out["floor_cpu_us_per_call"] = 1e6 * (floor_user + floor_system) / floor_calls
                out["floor_system_us_per_call"] = 1e6 * floor_system / floor_calls
            return out
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
    ``docker``, through a real sandbox; each beside its floor's (a bare uvloop server's, relaying to a
    Node echo for the Docker path)."""
    out: dict[str, Any] = {}
    why = callgrind.available()
    if why is not None:
        return {"skipped": why}
    paths = {"fake": "backend: fake\n"}
    if docker:
        paths["docker"] = f"sandbox:\n  image: {image}\n"
    for path, config in paths.items():
        user = f"instr-{path}-{run_id}@bench.example"
        say(f"instructions per warm call, {path} backend ({calls} calls under callgrind)")
        row = count(root / f"{path}-callgrind", config, user, calls, warmup=200, say=say)
        say(f"daemon CPU per warm call, {path} backend ({cpu_calls} calls in {CPU_ROUNDS} rounds, "
            f"alternating with the floor's)")
        relay = path == "docker"  # through Docker the daemon relays each call to a sandbox: its floor does too
        with cpu_floor.CpuFloor(relay=relay) as floor:
            row.update(cpu_per_call(root / f"{path}-cpu", config, user, cpu_calls, warmup=500, floor=floor))
        say(f"the daemon's floor under callgrind: a bare uvloop server{' relaying to a Node echo' if relay else ''}, "
            f"one task per call ({calls} calls)")
        row["floor"] = cpu_floor.count(calls, warmup=200, relay=relay)
        out[path] = row
    return out
