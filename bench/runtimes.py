"""runc beside gVisor (runsc) in the same run: warm and cold calls, idle memory (docs/performance.md, "gVisor").

One daemon per runtime, both running at once, the figures taken in alternation (warm calls in
rounds, cold first calls in pairs) so that both meet the machine in the same state; runsc is
skipped, saying why, when the engine does not have it as sandboxd needs it (`make gvisor`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

from bench import daemon as d
from bench.stats import summarize
from sandboxd.sandbox.docker.runtime import runtime_problem

RUNTIMES = ("runc", "runsc")
ROUNDS = 5


def compare_runtimes(api: Any, root: Path, run_id: str, image: str, *, calls: int, samples: int,
                     say: Callable[[str], None]) -> dict[str, Any]:
    from sandboxd.config import load_config
    from sandboxd.server.server import instance_id

    out: dict[str, Any] = {}
    problem = runtime_problem(api.info(), "runsc", local=True)
    if problem is not None:
        say(f"runsc: skipped ({problem})")
        return {"runsc": {"skipped": problem}}
    daemons, instances = {}, {}
    try:
        for runtime in RUNTIMES:
            config = f"pool:\n  max_total: 64\nsandbox:\n  image: {image}\n  runtime: {runtime}\n"
            daemon = daemons[runtime] = d.BenchDaemon(root / runtime, config, fresh_tools=0)
            daemon.start()
            instances[runtime] = instance_id(load_config(overrides={"socket": daemon.socket, "data_path": daemon.data},
                                                         environ={}))
        user = lambda runtime, tag: f"{runtime}-{tag}-{run_id}@bench.example"  # noqa: E731 - one place that names them
        say(f"warm hello, {calls} calls each in {ROUNDS} alternating rounds")
        warm: dict[str, list[float]] = {runtime: [] for runtime in RUNTIMES}
        conns = {runtime: daemons[runtime].connect() for runtime in RUNTIMES}
        try:
            templates = {runtime: d.daemon_call_line(user(runtime, "warm")) for runtime in RUNTIMES}
            for runtime in RUNTIMES:  # the first call starts the sandbox; the warm-up loads hello
                d.sequential_calls(conns[runtime], templates[runtime], min(500, calls), first_id=1)
                daemons[runtime].settle()
            for round_ in range(ROUNDS):
                for runtime in RUNTIMES:
                    first = 1000 + round_ * calls
                    warm[runtime] += d.sequential_calls(conns[runtime], templates[runtime], calls // ROUNDS,
                                                        first_id=first)
        finally:
            for conn in conns.values():
                conn.close()
        say(f"{samples} cold first calls each, in pairs")
        cold: dict[str, dict[str, Any]] = {}
        for i in range(samples):
            for runtime in RUNTIMES:
                cold.setdefault(runtime, {"rows": []})["rows"].append(
                    d.cold_first_call(daemons[runtime], [user(runtime, f"cold{i}")]))
        for runtime in RUNTIMES:
            figures: dict[str, Any] = {"warm": summarize(warm[runtime])}
            cold_ms = [row["p50_ms"] / 1000 for row in cold[runtime]["rows"]]  # one call each: its p50 is it
            figures["cold"] = summarize(cold_ms)
            figures["idle_memory"] = d.idle_sandbox_memory(daemons[runtime], api, instances[runtime])
            out[runtime] = figures
    finally:
        for runtime, daemon in daemons.items():
            daemon.stop()
            for container in api.containers(all=True, filters={"label": f"org.sandboxd.instance={instances.get(runtime)}"}):
                api.remove_container(container["Id"], force=True)
    return out
