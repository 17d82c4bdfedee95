"""Throughput: N clients, each its own process and connection, calling back to back.

A Python client costs CPU too, and on 2 cores it competes with the daemon: each
worker reports the CPU it used in the timed window, and the window's CPU is split
into daemon, clients and the rest (dockerd, containerd shims, node) so the figure
can be read for what it is.
"""

from __future__ import annotations

import gc
import json
import multiprocessing
import os
import time
from typing import Any

from bench.stats import summarize

_TICK = os.sysconf("SC_CLK_TCK")


def daemon_call_line(user: str, name: str = "hello", arguments: dict[str, Any] | None = None) -> bytes:
    """A tools/call request with a %d slot for its id, encoded once."""
    params = json.dumps({"user": user, "name": name, "arguments": arguments if arguments is not None else {"name": "World"}},
                        separators=(",", ":"))
    return b'{"jsonrpc":"2.0","id":%d,"method":"tools/call","params":' + params.replace("%", "%%").encode() + b"}\n"


def _round_tripper(kind: str, target: str, user: str) -> Any:
    """A function doing one call and returning its reply line, with what keeps it alive."""
    if kind == "daemon":
        from bench.wire import LineSocket

        conn = LineSocket(target)
        template = daemon_call_line(user)
        counter = iter(range(1, 1 << 62))

        def call() -> bytes:
            conn.send(template % next(counter))
            return conn.read_line()

        return call, conn
    import docker

    from bench.floors import CALL_LINE
    from bench.wire import attach

    api = docker.APIClient(version="auto", timeout=60)
    lines = attach(api, target)
    counter = iter(range(1, 1 << 62))

    def call_attach() -> bytes:
        i = next(counter)
        lines.send(CALL_LINE % (i, i))
        return lines.read_line()

    return call_attach, lines


def _worker(kind: str, target: str, user: str, warmup: int, duration: float, barrier: Any, out: Any) -> None:
    try:
        call, keep = _round_tripper(kind, target, user)
        for _ in range(warmup):
            call()
    except BaseException as exc:
        barrier.abort()
        out.put({"error": f"{type(exc).__name__}: {exc}"})
        return
    gc.disable()  # a collection in the client would show up as daemon latency
    barrier.wait()
    clock = time.perf_counter
    samples: list[float] = []
    failures = 0
    cpu0, t0 = time.process_time(), time.monotonic()
    end = t0 + duration
    while True:
        started = clock()
        reply = call()
        samples.append(clock() - started)
        if b'"status":"ok"' not in reply:
            failures += 1
        if time.monotonic() >= end:
            break
    t1, cpu1 = time.monotonic(), time.process_time()
    out.put({"calls": len(samples), "failures": failures, "seconds": t1 - t0, "cpu_s": cpu1 - cpu0,
             "latency": summarize(samples), "example": reply[:300].decode(errors="replace") if failures else None})
    keep.close()


def _machine_busy() -> tuple[float, float]:
    """(busy, total) CPU seconds of the whole machine since boot."""
    with open("/proc/stat") as f:
        fields = [int(x) for x in f.readline().split()[1:]]
    idle = fields[3] + fields[4]  # idle + iowait
    total = sum(fields[:8])
    return (total - idle) / _TICK, total / _TICK


def process_cpu(pid: int) -> float:
    """User + system CPU seconds of one process."""
    return sum(process_cpu_split(pid))


def process_cpu_split(pid: int) -> tuple[float, float]:
    """User and system (the kernel's, on the process's behalf) CPU seconds of one process."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return int(fields[11]) / _TICK, int(fields[12]) / _TICK


def throughput(kind: str, targets: list[tuple[str, str]], *, duration: float, warmup: int,
               daemon_pid: int | None = None) -> dict[str, Any]:
    """Run one worker process per (target, user) for ``duration`` seconds; calls/s and where the CPU went."""
    ctx = multiprocessing.get_context("spawn")  # no fork of a process holding docker clients and threads
    barrier = ctx.Barrier(len(targets) + 1)
    out = ctx.Queue()
    procs = [ctx.Process(target=_worker, args=(kind, target, user, warmup, duration, barrier, out), daemon=True)
             for target, user in targets]
    for proc in procs:
        proc.start()
    try:
        barrier.wait(timeout=120)
    except Exception:
        errors = []
        while not out.empty():
            errors.append(out.get().get("error"))
        for proc in procs:
            proc.kill()
        raise RuntimeError(f"throughput workers failed to start: {errors}")
    busy0, total0 = _machine_busy()
    daemon0 = process_cpu(daemon_pid) if daemon_pid else 0.0
    rows = [out.get(timeout=duration + 120) for _ in procs]
    busy1, total1 = _machine_busy()
    daemon1 = process_cpu(daemon_pid) if daemon_pid else 0.0
    for proc in procs:
        proc.join(timeout=10)
    errors = [r["error"] for r in rows if "error" in r]
    if errors:
        raise RuntimeError(f"throughput workers failed: {errors}")
    seconds = max(r["seconds"] for r in rows)
    calls = sum(r["calls"] for r in rows)
    wall = seconds
    cores = os.cpu_count() or 1
    client_cpu = sum(r["cpu_s"] for r in rows)
    daemon_cpu = daemon1 - daemon0
    machine_cpu = busy1 - busy0
    merged_p50 = sorted(r["latency"]["p50_ms"] for r in rows)[len(rows) // 2]
    return {
        "clients": len(targets),
        "calls": calls,
        "failures": sum(r["failures"] for r in rows),
        "seconds": seconds,
        "calls_per_s": calls / wall,
        "latency_p50_ms_median_client": merged_p50,
        "latency_p99_ms_worst_client": max(r["latency"]["p99_ms"] for r in rows),
        "cpu": {
            "machine_cores": cores,
            "machine_busy_pct": 100 * machine_cpu / ((total1 - total0) or 1),
            "client_cores_used": client_cpu / wall,
            "daemon_cores_used": daemon_cpu / wall if daemon_pid else None,
            "other_cores_used": (machine_cpu - client_cpu - daemon_cpu) / wall,
            "client_cpu_us_per_call": 1e6 * client_cpu / max(calls, 1),
            "daemon_cpu_us_per_call": 1e6 * daemon_cpu / max(calls, 1) if daemon_pid else None,
        },
        "example_failure": next((r["example"] for r in rows if r.get("example")), None),
    }
