"""What the cluster's check costs a warm call (docs/performance.md): the same daemon with and without a
``cluster:`` section, side by side. A test etcd on 127.0.0.1 holds the directory; the host with the
section asks its in-memory copy before each call and logs the call's ``call_served`` line. The two
daemons' calls alternate in rounds, so both share the machine's state.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any, Callable

from bench import daemon as d
from bench.load import daemon_call_line, process_cpu
from bench.stats import summarize

ROUNDS = 5


def cluster_cost(root: Path, run_id: str, image: str, *, calls: int, say: Callable[[str], None]) -> dict[str, Any]:
    if shutil.which("etcd") is None:
        return {"skipped": "etcd is missing (scripts/ci-deps.sh installs Debian's etcd-server)"}
    from tests.cluster.etcd import Etcd

    etcd = Etcd().start()
    base = f"pool:\n  min_idle: 1\nsandbox:\n  image: {image}\n"
    section = (f"cluster:\n  node: bench\n  etcd: [{etcd.url}]\n  advertise: 'bench.test:7443'\n"
               "  tls: {cert: /nonexistent/c.pem, key: /nonexistent/k.pem, ca: /nonexistent/ca.pem}\n")
    daemons = {"off": d.BenchDaemon(root / "off", base, fresh_tools=0),
               "on": d.BenchDaemon(root / "on", base + section, fresh_tools=0)}
    try:
        for daemon in daemons.values():
            daemon.start()
        say(f"a warm call with cluster: on and off ({calls} calls each, {ROUNDS} rounds)")
        return _alternate(daemons, f"cluster-{run_id}@bench.example", calls)
    finally:
        for daemon in daemons.values():
            daemon.stop()
        etcd.stop()


def _alternate(daemons: dict[str, d.BenchDaemon], user: str, calls: int) -> dict[str, Any]:
    template = daemon_call_line(user)
    conns = {name: daemon.connect() for name, daemon in daemons.items()}
    samples: dict[str, list[float]] = {name: [] for name in daemons}
    cpu_s = dict.fromkeys(daemons, 0.0)
    try:
        for name, conn in conns.items():
            d._check_ok(d._call(conn, template, 0)[1], f"the first call (cluster {name})")  # "on" claims the user
            d.sequential_calls(conn, template, 200, first_id=1)
        for daemon in daemons.values():
            daemon.settle()
        chunk = max(1, calls // ROUNDS)
        next_id = 201
        for _ in range(ROUNDS):
            for name, conn in conns.items():
                cpu0 = process_cpu(daemons[name].pid)
                samples[name] += d.sequential_calls(conn, template, chunk, first_id=next_id)
                cpu_s[name] += process_cpu(daemons[name].pid) - cpu0
            next_id += chunk
    finally:
        for conn in conns.values():
            conn.close()
    return {name: {**summarize(taken), "daemon_cpu_us_per_call": 1e6 * cpu_s[name] / len(taken)}
            for name, taken in samples.items()}
