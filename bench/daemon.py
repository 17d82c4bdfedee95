"""The real daemon under measurement: `sandboxd serve` as a subprocess, real image, real socket.

Each measurement here talks to it the way pi-bridge would: JSON lines over the
unix socket. Sandboxes get network `none`, as in the end-to-end tests.
"""

from __future__ import annotations

import datetime
import gc
import json
import multiprocessing
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

from bench.load import daemon_call_line, process_cpu
from bench.stats import summarize
from bench.wire import LineSocket

REPO = Path(__file__).resolve().parent.parent
BENCH_TOOLS = Path(__file__).resolve().parent / "tools"
FRESH_TOOL_TS = """\
type Params = {{ name: string }};

// A copy of the hello tool under another name ({n}), so that its first call is a first load.
export async function execute(_toolCallId: string, params: Params) {{
  const greeting: string = `Hello {n}, ${{params.name}}!`;
  return {{ content: [{{ type: 'text' as const, text: greeting }}] }};
}}
"""


class BenchDaemon:
    def __init__(self, root: Path, config_yaml: str, *, fresh_tools: int, command_prefix: list[str] | None = None,
                 environ: dict[str, str] | None = None) -> None:
        self.root = root
        self.command_prefix = command_prefix or []  # e.g. valgrind's, to count the daemon's instructions
        self.environ = environ or {}  # added to the daemon's environment
        root.mkdir(parents=True, exist_ok=True)
        self.data = root / "data"
        self.socket = Path(tempfile.mkdtemp(prefix="sbd-bench-")) / "sandboxd.sock"  # ≤ 108 bytes
        self.log_path = root / "daemon.log"
        self.config_path = root / "config.yaml"
        self.config_path.write_text(config_yaml)
        tools = self.data / "tools"
        shutil.copytree(BENCH_TOOLS, tools, dirs_exist_ok=True)
        self.fresh_tools = [f"bench_fresh_{i}" for i in range(fresh_tools)]
        for name in self.fresh_tools:
            (tools / name).mkdir(parents=True)
            (tools / name / "TOOL.md").write_text(
                f"---\nname: {name}\ndescription: A fresh copy of hello for the tool-load benchmark.\nversion: 1\n"
                "inputs:\n  name:\n    type: string\n    description: Who to greet.\n---\n\n# {name}\n")
            (tools / name / "index.ts").write_text(FRESH_TOOL_TS.format(n=name))
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def start(self, timeout: float = 60) -> None:
        env = {**os.environ, "SANDBOXD_SANDBOX_NETWORK": "none", **self.environ}
        env.pop("SANDBOXD_CONFIG", None)
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(
                [*self.command_prefix, sys.executable, "-m", "sandboxd", "serve", "--config", str(self.config_path),
                 "--data-path", str(self.data), "--socket", str(self.socket),
                 "--seed-tools", str(REPO / "seed" / "tools")],
                stdout=log, stderr=subprocess.STDOUT, env=env, cwd=REPO,
            )
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"sandboxd exited with {self.proc.returncode}:\n{self.log_tail()}")
            try:
                conn = LineSocket(str(self.socket), timeout=5)
                conn.request("ping")
                conn.close()
                return
            except OSError:
                time.sleep(0.05)
        raise RuntimeError(f"sandboxd did not listen within {timeout} s:\n{self.log_tail()}")

    def stop(self, timeout: float = 60) -> int | None:
        try:
            if self.proc is None or self.proc.poll() is not None:
                return None if self.proc is None else self.proc.returncode
            self.proc.send_signal(signal.SIGTERM)
            try:
                return self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                return self.proc.wait()
        finally:
            shutil.rmtree(self.socket.parent, ignore_errors=True)  # the socket's own directory (mkdtemp above)

    def log_tail(self, chars: int = 4000) -> str:
        return self.log_path.read_text(errors="replace")[-chars:] if self.log_path.exists() else ""

    def call_events(self, users: set[str], since: float = 0.0) -> list[dict[str, Any]]:
        """The daemon's own `call` log events for these users, logged after ``since`` (time.time())."""
        events = []  # JSON lines: the daemon's stderr is not a terminal
        for line in self.log_path.read_text(errors="replace").splitlines():
            if '"event": "call"' not in line and '"event":"call"' not in line:
                continue
            try:
                event = json.loads(line)
            except ValueError:
                continue
            if event.get("event") != "call" or event.get("user") not in users:
                continue
            stamp = event.get("timestamp")
            if since and (not stamp or datetime.datetime.fromisoformat(stamp).timestamp() < since):
                continue
            events.append(event)
        return events

    def connect(self) -> LineSocket:
        return LineSocket(str(self.socket))

    def status(self, conn: LineSocket | None = None) -> dict[str, Any]:
        if conn is not None:
            return conn.request("sandbox/status")
        own = self.connect()
        try:
            return own.request("sandbox/status")
        finally:
            own.close()

    def settle(self, timeout: float = 60) -> None:
        """Wait until no sandbox is starting and nothing is busy or queued (the background work is done)."""
        conn = self.connect()
        try:
            deadline = time.monotonic() + timeout
            while time.monotonic() < deadline:
                totals = self.status(conn)["pool"]["totals"]
                if not (totals["starting"] or totals["busy"] or totals.get("stopping") or totals["waiting"]):
                    return
                time.sleep(0.05)
            raise RuntimeError(f"the pool did not settle within {timeout} s: {totals}")
        finally:
            conn.close()


# -- measurements ---------------------------------------------------------------


def _call(conn: LineSocket, template: bytes, request_id: int) -> tuple[float, bytes]:
    started = time.perf_counter()
    conn.send(template % request_id)
    line = conn.read_line()
    return time.perf_counter() - started, line


def _check_ok(line: bytes, what: str) -> None:
    if b'"status":"ok"' not in line:
        raise RuntimeError(f"{what} did not succeed: {line[:400]!r}")


def sequential_calls(conn: LineSocket, template: bytes, count: int, *, first_id: int = 1) -> list[float]:
    samples = []
    gc.disable()  # a collection in the client would show up as daemon latency
    try:
        for i in range(first_id, first_id + count):
            elapsed, line = _call(conn, template, i)
            if b'"result"' not in line:
                raise RuntimeError(f"call {i} failed: {line[:400]!r}")
            samples.append(elapsed)
    finally:
        gc.enable()
    return samples


def calls_in_turns(daemon: BenchDaemon, templates: dict[str, bytes], calls: int, rounds: int = 5) -> dict[str, Any]:
    """Warm calls of each template (200 first, unmeasured), then ``calls`` more each in ``rounds`` rounds that
    take turns, so that all share the machine's state; each template's latencies summarized."""
    conn = daemon.connect()
    try:
        for template in templates.values():
            sequential_calls(conn, template, 200)
        daemon.settle()
        samples: dict[str, list[float]] = {name: [] for name in templates}
        for _ in range(rounds):
            for name, template in templates.items():
                samples[name] += sequential_calls(conn, template, max(1, calls // rounds))
        return {name: summarize(seconds) for name, seconds in samples.items()}
    finally:
        conn.close()


def ping_latency(daemon: BenchDaemon, count: int) -> dict[str, Any]:
    conn = daemon.connect()
    try:
        template = b'{"jsonrpc":"2.0","id":%d,"method":"ping"}\n'
        sequential_calls(conn, template, min(count, 500))
        return summarize(sequential_calls(conn, template, count, first_id=1000))
    finally:
        conn.close()


def warm_latency(daemon: BenchDaemon, user: str, count: int, warmup: int) -> dict[str, Any]:
    """Back-to-back hello calls of one user on one connection, after a warm-up that loads hello."""
    conn = daemon.connect()
    try:
        template = daemon_call_line(user)
        _check_ok(_call(conn, template, 0)[1], "the first hello call")
        sequential_calls(conn, template, warmup, first_id=1)
        daemon.settle()
        cpu0 = process_cpu(daemon.pid)
        samples = sequential_calls(conn, template, count, first_id=warmup + 1)
        cpu_us = 1e6 * (process_cpu(daemon.pid) - cpu0) / count
        return {**summarize(samples), "daemon_cpu_us_per_call": cpu_us}
    finally:
        conn.close()


def warm_rounds(daemon: BenchDaemon, user: str, floor: Callable[[int], list[float]] | None, count: int, warmup: int,
                rounds: int = 5) -> dict[str, Any]:
    """Back-to-back hello calls of one user, after a warm-up that loads hello: pre-encoded on a raw
    connection (the client sends bytes, the GC off), and through sandboxd.client (each request
    encoded and each answer decoded by json, the GC on: what a plain Python client sees). Each
    gets ``count`` samples in ``rounds`` rounds that alternate with the attach floor's (``floor(n)``:
    n round trips), so that all three share the machine's state: the floor's p50 alone moved by
    half between runs minutes apart."""
    from sandboxd.client import Client

    chunk = max(1, count // rounds)
    floor_samples: list[float] = []
    warm_samples: list[float] = []
    plain_samples: list[float] = []
    cpu_s = 0.0
    conn = daemon.connect()
    try:
        with Client(daemon.socket, timeout=60) as client:
            template = daemon_call_line(user)
            _check_ok(_call(conn, template, 0)[1], "the first hello call")
            sequential_calls(conn, template, warmup, first_id=1)
            for _ in range(warmup):
                client.call_tool(user, "hello", {"name": "World"})
            if floor is not None:
                floor(warmup)
            daemon.settle()
            next_id = warmup + 1
            for _ in range(rounds):
                if floor is not None:
                    floor_samples += floor(chunk)
                cpu0 = process_cpu(daemon.pid)
                warm_samples += sequential_calls(conn, template, chunk, first_id=next_id)
                cpu_s += process_cpu(daemon.pid) - cpu0
                next_id += chunk
                for _ in range(chunk):
                    started = time.perf_counter()
                    client.call_tool(user, "hello", {"name": "World"})
                    plain_samples.append(time.perf_counter() - started)
    finally:
        conn.close()
    return {
        "warm": {**summarize(warm_samples), "daemon_cpu_us_per_call": 1e6 * cpu_s / len(warm_samples)},
        "plain_warm": summarize(plain_samples),
        "floor": {**summarize(floor_samples), "rounds": rounds} if floor_samples else None,
    }


def node_client_latency(daemon: BenchDaemon, user: str, count: int, warmup: int) -> dict[str, Any]:
    """The same warm hello calls through @sandboxd/client in Node: what a pi session (clients/pi) sees."""
    client = REPO / "clients" / "typescript" / "dist" / "index.js"
    node = shutil.which("node")
    if node is None or not client.exists():
        raise RuntimeError(f"the Node client figure needs node and {client}: run `make clients` (or --skip node)")
    daemon.settle()
    done = subprocess.run([node, str(REPO / "bench" / "node_client.mjs"), str(daemon.socket), user, str(count), str(warmup)],
                          capture_output=True, text=True, timeout=600)
    if done.returncode != 0:
        raise RuntimeError(f"bench/node_client.mjs failed ({done.returncode}): {done.stderr[-2000:]}")
    return summarize(json.loads(done.stdout)["seconds"])


MCP_HELLO = b'{"jsonrpc":"2.0","id":%d,"method":"tools/call","params":{"name":"hello","arguments":{"name":"World"}}}\n'


def mcp_stdio_latency(daemon: BenchDaemon, user: str, count: int, warmup: int, rounds: int = 5) -> dict[str, Any]:
    """The warm hello call through `sandboxd mcp` on stdio (pre-encoded MCP lines on its pipes, what
    an MCP host's transport does) in rounds alternating with the same call in our protocol on the
    daemon's socket, so that both share the machine's state; and the MCP server's CPU per call."""
    proc = subprocess.Popen([sys.executable, "-m", "sandboxd", "mcp", "--user", user, "--socket", str(daemon.socket),
                             "--config", str(daemon.config_path)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL, cwd=REPO, env={k: v for k, v in os.environ.items()
                                                                      if not k.startswith("SANDBOXD_")})
    assert proc.stdin is not None and proc.stdout is not None
    stdin, stdout = proc.stdin, proc.stdout

    def mcp_call(request_id: int) -> tuple[float, bytes]:
        started = time.perf_counter()
        stdin.write(MCP_HELLO % request_id)
        stdin.flush()
        line = stdout.readline()
        return time.perf_counter() - started, line

    conn = daemon.connect()
    try:
        stdin.write(b'{"jsonrpc":"2.0","id":0,"method":"initialize","params":{"protocolVersion":"2025-11-25",'
                    b'"capabilities":{},"clientInfo":{"name":"bench","version":"1"}}}\n'
                    b'{"jsonrpc":"2.0","method":"notifications/initialized"}\n')
        stdin.flush()
        if b'"serverInfo"' not in stdout.readline():
            raise RuntimeError("sandboxd mcp did not answer initialize")
        template = daemon_call_line(user)
        for i in range(1, warmup + 1):
            line = mcp_call(i)[1]
            if b'"isError":false' not in line:
                raise RuntimeError(f"a hello call through sandboxd mcp failed: {line[:400]!r}")
        sequential_calls(conn, template, warmup, first_id=1)
        daemon.settle()
        chunk = max(1, count // rounds)
        mcp_samples: list[float] = []
        protocol_samples: list[float] = []
        cpu_s = 0.0
        next_id = warmup + 1
        gc.disable()
        try:
            for _ in range(rounds):
                protocol_samples += sequential_calls(conn, template, chunk, first_id=next_id)
                cpu0 = process_cpu(proc.pid)
                for i in range(next_id, next_id + chunk):
                    elapsed, line = mcp_call(i)
                    if b'"result"' not in line:
                        raise RuntimeError(f"call {i} through sandboxd mcp failed: {line[:400]!r}")
                    mcp_samples.append(elapsed)
                cpu_s += process_cpu(proc.pid) - cpu0
                next_id += chunk
        finally:
            gc.enable()
    finally:
        conn.close()
        stdin.close()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    return {"mcp": {**summarize(mcp_samples), "server_cpu_us_per_call": 1e6 * cpu_s / len(mcp_samples)},
            "protocol": summarize(protocol_samples)}


def returning_user(daemon: BenchDaemon, user: str, samples: int, pause_s: float) -> dict[str, Any]:
    """The first call after a pause of a user whose sandbox is warm (called before, within the idle TTL)."""
    template = daemon_call_line(user)
    times = []
    for i in range(samples):
        time.sleep(pause_s)
        conn = daemon.connect()  # a returning agent session opens a new connection
        try:
            elapsed, line = _call(conn, template, i)
            _check_ok(line, "a returning user's call")
            times.append(elapsed)
        finally:
            conn.close()
    return summarize(times)


def listed_first_call(daemon: BenchDaemon, users: list[str]) -> dict[str, Any]:
    """A new user's first call after their session listed their tools (which warms the pool), as pi does:
    from sending the call to its answer; beside it, what the daemon says the call took and waited."""
    times, reported = [], []
    for user in users:
        daemon.settle()
        conn = daemon.connect()
        try:
            conn.request("tools/list", {"user": user})
            daemon.settle()  # the model's first call comes seconds after the session start
            elapsed, line = _call(conn, daemon_call_line(user), 1)
            _check_ok(line, f"the first call of {user} after tools/list")
            times.append(elapsed)
            reported.append(json.loads(line)["result"]["durationMs"])
        finally:
            conn.close()
    daemon.settle()
    time.sleep(0.2)  # the daemon logs each call just after answering it
    # queue_ms 0: the listing's warm-up had the sandbox ready; the rest is the call in a fresh sandbox.
    waits = [e.get("queue_ms") for e in daemon.call_events(set(users))]
    return {**summarize(times), "daemon_reported_ms": reported, "queue_ms": waits}


def cold_first_call(daemon: BenchDaemon, users: list[str], floor: Callable[[], float] | None = None) -> dict[str, Any]:
    """The first call of a user never seen before: a sandbox starts on the caller's path.

    With ``floor`` (one create→reply of an echo container), a floor sample is taken just
    before each call, so that each pair meets the engine in the same state."""
    times, reported, floors = [], [], []
    for user in users:
        daemon.settle()
        if floor is not None:
            floors.append(floor())
            daemon.settle()
        conn = daemon.connect()
        try:
            elapsed, line = _call(conn, daemon_call_line(user), 1)
            _check_ok(line, f"the first call of {user}")
            times.append(elapsed)
            reported.append(json.loads(line)["result"]["durationMs"])
        finally:
            conn.close()
    daemon.settle()
    time.sleep(0.2)
    waits = [e.get("queue_ms") for e in daemon.call_events(set(users))]
    out = {**summarize(times), "daemon_reported_ms": reported, "queue_ms": waits}
    if floors:
        out["floor"] = summarize(floors)
    return out


def tool_first_call(daemon: BenchDaemon, user: str) -> dict[str, Any]:
    """First call of a tool the warm sandbox has not loaded (transpile + load), then its second call."""
    conn = daemon.connect()
    try:
        _check_ok(_call(conn, daemon_call_line(user), 1)[1], "warming the user")
        daemon.settle()
        first, second = [], []
        for i, name in enumerate(daemon.fresh_tools):
            template = daemon_call_line(user, name)
            elapsed, line = _call(conn, template, 10 + 2 * i)
            _check_ok(line, f"the first call of {name}")
            first.append(elapsed)
            elapsed, line = _call(conn, template, 11 + 2 * i)
            _check_ok(line, f"the second call of {name}")
            second.append(elapsed)
        return {"first": summarize(first), "second": summarize(second)}
    finally:
        conn.close()


def progress_rate(daemon: BenchDaemon, user: str, steps: int, runs: int) -> dict[str, Any]:
    """Progress notifications per second reaching the client from a tool calling onUpdate in a loop."""
    conn = daemon.connect()
    try:
        best: dict[str, Any] | None = None
        for run in range(runs + 1):  # run 0 loads the tool and is not counted
            request = daemon_call_line(user, "bench_progress_flood", {"steps": steps}) % run
            request = request.replace(b'"params":{', b'"params":{"_meta":{"progressToken":"p%d"},' % run, 1)
            started = time.perf_counter()
            conn.send(request)
            received = 0
            first_at = last_at = started
            while True:
                line = conn.read_line()
                if line.startswith(b'{"jsonrpc":"2.0","method":"notifications/progress"'):
                    received += 1
                    last_at = time.perf_counter()
                    if received == 1:
                        first_at = last_at
                    continue
                break
            elapsed = time.perf_counter() - started
            _check_ok(line, "the progress flood")
            if received != steps:
                raise RuntimeError(f"expected {steps} progress notifications, got {received}")
            row = {"count": received, "seconds": elapsed, "per_s": received / elapsed,
                   "first_to_last_s": last_at - first_at}
            if run and (best is None or row["per_s"] > best["per_s"]):
                best = row
        assert best is not None
        return best
    finally:
        conn.close()


# -- memory ------------------------------------------------------------------------


def container_memory(container_id: str) -> dict[str, Any] | None:
    """A container's memory as `docker stats` counts it (usage minus inactive file cache), cgroup v1 or v2."""
    candidates = [
        (Path(f"/sys/fs/cgroup/memory/docker/{container_id}"), "memory.usage_in_bytes", "total_inactive_file", "total_rss"),
        (Path(f"/sys/fs/cgroup/system.slice/docker-{container_id}.scope"), "memory.current", "inactive_file", "anon"),
        (Path(f"/sys/fs/cgroup/docker/{container_id}"), "memory.current", "inactive_file", "anon"),
    ]
    for directory, usage_file, inactive_key, anon_key in candidates:
        if not (directory / usage_file).exists():
            continue
        usage = int((directory / usage_file).read_text())
        stat = dict(line.split() for line in (directory / "memory.stat").read_text().splitlines())
        inactive = int(stat.get(inactive_key, 0))
        return {"mb": (usage - inactive) / 2**20 if inactive < usage else usage / 2**20,
                "usage_mb": usage / 2**20, "anon_mb": int(stat.get(anon_key, 0)) / 2**20}
    return None


def idle_sandbox_memory(daemon: BenchDaemon, api: Any, instance: str) -> dict[str, Any]:
    daemon.settle()
    time.sleep(1.0)  # let node's post-call allocations settle back
    rows = []
    for container in api.containers(filters={"label": f"org.sandboxd.instance={instance}"}):
        row = container_memory(container["Id"])
        if row is not None:
            rows.append(row)
    if not rows:
        return {"n": 0, "skipped": "no cgroup memory files found for the sandboxes"}
    mbs = sorted(r["mb"] for r in rows)
    return {"n": len(rows), "median_mb": mbs[len(mbs) // 2], "max_mb": mbs[-1],
            "median_anon_mb": sorted(r["anon_mb"] for r in rows)[len(rows) // 2]}


def process_rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


# -- refill after a kill -----------------------------------------------------------------


def _background_caller(socket_path: str, user: str, stop: Any, out: Any) -> None:
    """Calls back to back until told to stop; reports (start time, latency) of each call."""
    conn = LineSocket(socket_path)
    template = daemon_call_line(user)
    rows = []
    i = 0
    while not stop.is_set():
        i += 1
        started = time.monotonic()
        t0 = time.perf_counter()
        conn.send(template % i)
        line = conn.read_line()
        rows.append((started, time.perf_counter() - t0, b'"status":"ok"' in line))
        # Paced so that its own sandbox recycling (pool.max_calls_per_sandbox) has time to
        # warm a replacement even on a loaded machine: only the refill is under test.
        time.sleep(0.005)
    out.put(rows)


def refill_after_kill(daemon: BenchDaemon, api: Any, instance: str, user: str, bystander: str,
                      kills: int, min_idle: int) -> dict[str, Any]:
    """`docker kill` every warm sandbox of ``user``; time until the pool has min_idle idle again.

    Meanwhile another user (``bystander``) calls back to back: its latencies inside the
    refill windows show whether the refill ever sits on a caller's path.
    """
    conn = daemon.connect()
    for who in (user, bystander):
        _check_ok(_call(conn, daemon_call_line(who), 1)[1], f"warming {who}")
    daemon.settle()
    ctx = multiprocessing.get_context("spawn")
    stop, out = ctx.Event(), ctx.Queue()
    caller = ctx.Process(target=_background_caller, args=(str(daemon.socket), bystander, stop, out), daemon=True)
    caller.start()
    time.sleep(1.5)  # the caller's interpreter starts; its calls before the first kill are the baseline
    windows, refill_s, next_call_s = [], [], []
    first_kill_wall = time.time()
    try:
        for _ in range(kills):
            daemon.settle()
            before = daemon.status(conn)["pool"]
            victims = [c["Id"] for c in api.containers(filters={"label": [
                f"org.sandboxd.instance={instance}", f"org.sandboxd.user={user}"]})]
            crashed0 = before["counters"]["crashed"]
            t0 = time.monotonic()
            for cid in victims:
                api.kill(cid)
            while True:
                pool = daemon.status(conn)["pool"]
                row = pool["users"].get(user, {})
                # Once every death is counted the dead are out of the pool, so "idle" counts live sandboxes only.
                if pool["counters"]["crashed"] >= crashed0 + len(victims) and row.get("idle", 0) >= min_idle:
                    break
                if time.monotonic() - t0 > 60:
                    raise RuntimeError(f"the pool did not refill within 60 s: {pool}")
                time.sleep(0.002)
            t1 = time.monotonic()
            refill_s.append(t1 - t0)
            windows.append((t0, t1))
            # The user's next call after the refill: served by the new sandbox, which has not loaded hello yet.
            elapsed, line = _call(conn, daemon_call_line(user), 2)
            _check_ok(line, "the call after a refill")
            next_call_s.append(elapsed)
            time.sleep(0.3)
    finally:
        stop.set()
        rows = out.get(timeout=30)
        caller.join(timeout=10)
        conn.close()
    inside = [lat for (at, lat, _ok) in rows if any(a <= at <= b for a, b in windows)]
    baseline = [lat for (at, lat, _ok) in rows if at < windows[0][0]] if windows else []
    time.sleep(0.2)  # the daemon logs each call just after answering it
    # The daemon's log says how long each call waited for a sandbox: 0 everywhere means no
    # caller, of the killed user or another, ever waited on a refill.
    events = daemon.call_events({user, bystander}, since=first_kill_wall)
    waits = [e.get("queue_ms") for e in events]
    waited = [{k: e.get(k) for k in ("user", "queue_ms", "duration_ms", "sandbox", "timestamp")}
              for e in events if e.get("queue_ms")]
    return {
        **summarize(refill_s),
        "kills": kills,
        "sandboxes_killed_each_time": len(victims),
        "next_call_after_refill": summarize(next_call_s),
        "bystander_in_refill": summarize(inside),
        "bystander_baseline": summarize(baseline),
        "bystander_failures": sum(1 for (_a, _l, ok) in rows if not ok),
        "calls_logged": len(waits),
        "max_queue_ms": max((w for w in waits if w is not None), default=None),
        "calls_that_waited": waited[:20],
    }


# -- density -------------------------------------------------------------------------


def _fill(daemon: BenchDaemon, users: list[str], callers: int) -> float:
    """Each user's first call (one warm sandbox each), from ``callers`` threads; the seconds it took."""
    import threading

    queue = list(reversed(users))
    lock = threading.Lock()
    failures: list[str] = []

    def caller() -> None:
        conn = daemon.connect()
        try:
            while True:
                with lock:
                    if not queue:
                        return
                    user = queue.pop()
                line = _call(conn, daemon_call_line(user), 1)[1]
                if b'"status":"ok"' not in line:
                    failures.append(line[:300].decode(errors="replace"))
        finally:
            conn.close()

    started = time.perf_counter()
    threads = [threading.Thread(target=caller) for _ in range(callers)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if failures:
        raise RuntimeError(f"{len(failures)} first calls failed while filling, e.g. {failures[0]}")
    return time.perf_counter() - started


def _request_latency(daemon: BenchDaemon, line: bytes, count: int) -> dict[str, Any]:
    conn = daemon.connect()
    try:
        sequential_calls(conn, line, min(count, 20))
        return summarize(sequential_calls(conn, line, count, first_id=100))
    finally:
        conn.close()


def _wait_for_quiet(busy_pct: float = 10.0, windows: int = 3, limit_s: float = 90.0) -> float:
    """Wait until the machine is less than ``busy_pct`` busy in ``windows`` one-second windows in a row
    (at most ``limit_s``). After 400 starts a call's p99 stayed raised for ~20-60 s (2.1 -> 0.9 ms,
    the daemon's CPU per call flat) while half a second under 20% busy had passed at once."""
    from bench.load import _machine_busy

    started = time.monotonic()
    quiet = 0
    while time.monotonic() - started < limit_s and quiet < windows:
        busy0, total0 = _machine_busy()
        time.sleep(1.0)
        busy1, total1 = _machine_busy()
        quiet = quiet + 1 if 100 * (busy1 - busy0) / ((total1 - total0) or 1) < busy_pct else 0
    return time.monotonic() - started


def median_round(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    """Each figure's median over rounds measured apart (a p99 of one round moves with whatever else
    ran on the machine then), with the rounds themselves kept."""
    keys = ("p50_ms", "p99_ms", "p999_ms", "mean_ms", "daemon_cpu_us_per_call")
    return {**{key: statistics.median(r[key] for r in rounds) for key in keys}, "rounds": rounds}


def density(daemon: BenchDaemon, run_id: str, sizes: list[int], callers: int, calls: int,
            rounds_per_size: int = 3) -> dict[str, Any]:
    """Users each holding one warm sandbox (min_idle 0), filled up to each size in turn; at each size
    one user's warm calls (``rounds_per_size`` rounds of ``calls``, each figure their median),
    sandbox/status and tools/list against the same with that user alone."""
    probe = f"dense-probe-{run_id}@bench.example"
    status = b'{"jsonrpc":"2.0","id":%d,"method":"sandbox/status"}\n'
    listing = b'{"jsonrpc":"2.0","id":%d,"method":"tools/list","params":{"user":"' + probe.encode() + b'"}}\n'

    def measure() -> dict[str, Any]:
        daemon.settle(timeout=300)
        quiet_s, rounds = [], []
        for _ in range(rounds_per_size):  # each after a quiet machine: dockerd works on for seconds after a fill
            quiet_s.append(_wait_for_quiet())
            rounds.append(warm_latency(daemon, probe, calls, warmup=200))
        return {"quiet_after_s": quiet_s, "call": median_round(rounds),
                "status": _request_latency(daemon, status, 200), "list": _request_latency(daemon, listing, 200),
                "daemon_rss_mb": process_rss_mb(daemon.pid), "sandboxes": daemon.status()["pool"]["totals"]["idle"]}

    out: dict[str, Any] = {"callers": callers, "alone": measure(), "sizes": []}
    filled = 0
    for size in sizes:
        users = [f"dense{i}-{run_id}@bench.example" for i in range(filled, size)]
        seconds = _fill(daemon, users, callers)
        filled = size
        row = {"users": size, "fill_s": seconds, "started_per_s": len(users) / seconds, **measure()}
        out["sizes"].append(row)
    return out
