"""Soak: many calls from many clients, with random cancels and timeouts, against a
real daemon on real Docker. Run on demand: `make soak` (or pytest tests/soak -m soak -s).

Asserted: every request gets exactly one answer (none lost, none duplicated), each
with a status its kind allows; the daemon's memory is flat after warm-up; the
number of containers stays within the pool's limits. Printed: the rate and the
figures. SOAK_CALLS (default 100000) and SOAK_CLIENTS (default 16) scale it.
"""

from __future__ import annotations

import asyncio
import collections
import json
import os
import random
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import docker
import pytest

from tests.e2e.conftest import Daemon

pytestmark = [pytest.mark.soak, pytest.mark.docker]

TOTAL_CALLS = int(os.environ.get("SOAK_CALLS", "100000"))
CLIENTS = int(os.environ.get("SOAK_CLIENTS", "16"))
IN_FLIGHT_PER_CLIENT = 2
USERS = [f"soak{i}@example.com" for i in range(4)]
CONFIG = """\
pool:
  max_per_user: 4
  max_total: 16
  min_idle: 1
  acquire_timeout_ms: 30000
calls:
  cancel_grace_ms: 1000
log_level: warning
"""
MAX_TOTAL = 16
RSS_GROWTH_LIMIT_KB = 32 * 1024


def rss_kb(pid: int) -> int:
    return int(Path(f"/proc/{pid}/status").read_text().split("VmRSS:")[1].split()[0])


class Tally:
    def __init__(self) -> None:
        self.sent = 0
        self.answered = 0
        self.duplicates: list[Any] = []
        self.unexpected: list[Any] = []
        self.by_kind: dict[str, collections.Counter[str]] = collections.defaultdict(collections.Counter)


# kind → (weight, the statuses (or error codes) its answer may have)
KINDS = {
    "hello": (0.90, {"ok"}),
    "progress": (0.04, {"ok"}),
    "cancel": (0.05, {"cancelled", "ok"}),  # ok: it finished before the cancel arrived
    "timeout": (0.01, {"timeout"}),
}


def pick_kind(rng: random.Random) -> str:
    roll, acc = rng.random(), 0.0
    for kind, (weight, _) in KINDS.items():
        acc += weight
        if roll < acc:
            return kind
    return "hello"


async def client(index: int, calls: int, socket_path: str, tally: Tally, seed: int) -> None:
    rng = random.Random(seed)
    user = USERS[index % len(USERS)]
    reader, writer = await asyncio.open_unix_connection(socket_path, limit=1 << 22)
    outstanding: dict[int, str] = {}
    answered: set[int] = set()
    next_id = 0
    slots = asyncio.Semaphore(IN_FLIGHT_PER_CLIENT)
    done = asyncio.Event()

    async def read() -> None:
        while len(answered) < calls:
            line = await reader.readline()
            if not line:
                raise AssertionError(f"client {index}: the daemon closed the connection")
            message = json.loads(line)
            if message.get("method") == "notifications/progress":
                continue
            request_id = message.get("id")
            if request_id in answered or request_id not in outstanding:
                tally.duplicates.append(message)
                continue
            kind = outstanding.pop(request_id)
            answered.add(request_id)
            tally.answered += 1
            outcome = message["result"]["status"] if "result" in message else str(message["error"]["code"])
            tally.by_kind[kind][outcome] += 1
            if outcome not in KINDS[kind][1]:
                tally.unexpected.append((kind, message))
            slots.release()
        done.set()

    reading = asyncio.create_task(read())
    for _ in range(calls):
        await slots.acquire()
        next_id += 1
        request_id, kind = next_id, pick_kind(rng)
        params: dict[str, Any] = {"user": user, "name": "hello", "arguments": {"name": f"c{index}-{request_id}"}}
        if kind == "progress":
            params = {"user": user, "name": "progress", "arguments": {"steps": 3}}
        elif kind == "cancel":
            params = {"user": user, "name": "sleeper", "arguments": {"ms": rng.randint(50, 2000)}}
        elif kind == "timeout":
            params = {"user": user, "name": "sleeper", "arguments": {"ms": 5000}, "timeoutMs": rng.randint(50, 300)}
        outstanding[request_id] = kind
        tally.sent += 1
        writer.write(json.dumps({"jsonrpc": "2.0", "id": request_id, "method": "tools/call", "params": params}).encode() + b"\n")
        if kind == "cancel":
            delay = rng.uniform(0.0, 0.5)
            asyncio.get_running_loop().call_later(delay, lambda rid=request_id: writer.write(json.dumps(
                {"jsonrpc": "2.0", "method": "notifications/cancelled", "params": {"requestId": rid, "reason": "soak"}}).encode() + b"\n"))
        await writer.drain()
    await asyncio.wait_for(done.wait(), 120)
    await reading
    assert not outstanding, f"client {index}: {len(outstanding)} requests never answered"
    writer.close()


async def sample(pid: int, label: str, api: Any, samples: list[tuple[float, int, int]], stop: asyncio.Event) -> None:
    loop = asyncio.get_running_loop()
    while not stop.is_set():
        containers = await loop.run_in_executor(None, lambda: len(api.containers(all=True, filters={"label": label})))
        samples.append((time.monotonic(), rss_kb(pid), containers))
        try:
            await asyncio.wait_for(stop.wait(), 2)
        except TimeoutError:
            pass


def test_soak() -> None:
    api = docker.APIClient(version="auto")
    tmp = Path(tempfile.mkdtemp(prefix="sandboxd-soak-"))
    daemon = Daemon(tmp, config=CONFIG)
    daemon.start()
    assert daemon.proc is not None
    label = f"org.sandboxd.instance={daemon.instance_label()}"
    tally = Tally()
    samples: list[tuple[float, int, int]] = []
    try:
        async def main() -> float:
            stop = asyncio.Event()
            sampler = asyncio.create_task(sample(daemon.proc.pid, label, api, samples, stop))
            started = time.monotonic()
            per_client = [TOTAL_CALLS // CLIENTS + (1 if i < TOTAL_CALLS % CLIENTS else 0) for i in range(CLIENTS)]
            await asyncio.gather(*(client(i, n, str(daemon.socket), tally, seed=i) for i, n in enumerate(per_client)))
            elapsed = time.monotonic() - started
            stop.set()
            await sampler
            return elapsed

        elapsed = asyncio.run(main())
    finally:
        daemon.stop()
        leftovers = api.containers(all=True, filters={"label": label})
        for container in leftovers:
            api.remove_container(container["Id"], force=True)
        shutil.rmtree(tmp, ignore_errors=True)

    warm = [s for s in samples if s[0] - samples[0][0] >= min(30.0, elapsed / 5)] or samples
    rss_after_warmup = [s[1] for s in warm]
    report = {
        "calls": TOTAL_CALLS, "clients": CLIENTS, "seconds": round(elapsed, 1), "calls_per_s": round(TOTAL_CALLS / elapsed),
        "answered": tally.answered, "duplicates": len(tally.duplicates), "unexpected": len(tally.unexpected),
        "outcomes": {kind: dict(counter) for kind, counter in tally.by_kind.items()},
        "rss_mb": {"start": round(samples[0][1] / 1024, 1), "after_warmup": round(rss_after_warmup[0] / 1024, 1),
                   "max": round(max(s[1] for s in samples) / 1024, 1), "end": round(samples[-1][1] / 1024, 1),
                   "median_after_warmup": round(statistics.median(rss_after_warmup) / 1024, 1)},
        "containers": {"max": max(s[2] for s in samples), "end": samples[-1][2]},
        # About ten points over the run, to see whether memory levels off.
        "rss_mb_series": [round(s[1] / 1024, 1) for s in samples[:: max(1, len(samples) // 10)]],
    }
    print("\nsoak:", json.dumps(report, indent=2))
    assert tally.sent == TOTAL_CALLS == tally.answered, "lost answers"
    assert not tally.duplicates, tally.duplicates[:5]
    assert not tally.unexpected, tally.unexpected[:5]
    assert rss_after_warmup[-1] - rss_after_warmup[0] < RSS_GROWTH_LIMIT_KB, "the daemon's memory grew"
    assert report["containers"]["max"] <= MAX_TOTAL, "more containers than the pool allows (those being removed count too)"
    assert not leftovers, f"{len(leftovers)} containers left behind"
