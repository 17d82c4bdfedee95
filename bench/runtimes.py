"""runc beside gVisor (runsc) in the same run: warm and cold calls, idle memory (docs/performance.md, "gVisor").

One daemon per runtime, one after the other, the same figures taken the same way; runsc is
skipped, saying why, when the engine does not have it as sandboxd needs it (`make gvisor`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from bench import daemon as d
from sandboxd.sandbox.docker_runtime import runtime_problem

RUNTIMES = ("runc", "runsc")


def compare_runtimes(api: Any, root: Path, run_id: str, image: str, *, calls: int, samples: int,
                     say: Any) -> dict[str, Any]:
    from sandboxd.config import load_config
    from sandboxd.server.server import instance_id

    out: dict[str, Any] = {}
    info = api.info()
    for runtime in RUNTIMES:
        problem = runtime_problem(info, runtime, local=True) if runtime != "runc" else None
        if problem is not None:
            say(f"{runtime}: skipped ({problem})")
            out[runtime] = {"skipped": problem}
            continue
        say(f"{runtime}: warm hello ({calls} calls), {samples} cold first calls, idle memory")
        config = f"pool:\n  max_total: 64\nsandbox:\n  image: {image}\n  runtime: {runtime}\n"
        daemon = d.BenchDaemon(root / runtime, config, fresh_tools=0)
        daemon.start()
        instance = instance_id(load_config(overrides={"socket": daemon.socket, "data_path": daemon.data}, environ={}))
        user = lambda tag: f"{runtime}-{tag}-{run_id}@bench.example"  # noqa: E731 - one place that names the users
        try:
            figures: dict[str, Any] = {}
            figures["warm"] = d.warm_latency(daemon, user("warm"), calls, warmup=min(500, calls))
            figures["cold"] = d.cold_first_call(daemon, [user(f"cold{i}") for i in range(samples)])
            figures["idle_memory"] = d.idle_sandbox_memory(daemon, api, instance)
            out[runtime] = figures
        finally:
            daemon.stop()
            for container in api.containers(all=True, filters={"label": f"org.sandboxd.instance={instance}"}):
                api.remove_container(container["Id"], force=True)
    return out
