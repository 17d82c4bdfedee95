"""The fork-bomb kill, many times over: is every condemned sandbox gone within 15 s? (issue 44, item 9)

Not part of `make test` (20 runs of 20 take about 20 minutes and load both cores). As root, with the
runner image built:

    E2E_SANDBOX_RUNTIME=runsc .venv/bin/python -m tests.e2e.stress_kill --runs 20 --per-run 20

Each run lights the bomb of tests/e2e/test_kill.py in ``--per-run`` sandboxes, ``--batch`` at a time
(one user each), lets it spread until the call's timeout (``--bomb-s``) condemns the sandbox, and
measures from the timeout until the engine no longer lists the container. One line per run, then the
worst. The pids limit keeps this host's pid space (kernel.pid_max) for everyone else.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import docker

from tests.e2e.conftest import RUNTIME, Daemon, write_tool
from tests.e2e.test_kill import BOMB, GONE_WITHIN_S, sandbox_threads_of

USERS = [f"bomber{i}@example.com" for i in range(64)]
INPUTS = "  marker:\n    type: string\n    description: Marks its processes.\n"


def config(batch: int, pids_limit: int) -> str:
    return (f"sandbox:\n  pids_limit: {pids_limit}\n  cpus: 0.25\n  memory: 1g\n"
            f"pool:\n  min_idle: 0\n  max_total: {batch + 2}\n  max_per_user: 1\n")


def one_kill(daemon: Daemon, api: Any, user: str, bomb_s: float) -> dict[str, Any]:
    """Light the bomb as ``user``; return the call's status, the peak threads and how long the sandbox outlived its timeout."""
    peak = [-1]
    answer: list[dict[str, Any]] = []

    def call() -> None:
        with daemon.client(timeout=bomb_s + 120) as client:
            answer.append(client.call_tool(user, "bomber", {"marker": f"stress{time.monotonic_ns()}"},
                                           timeoutMs=int(bomb_s * 1000)))

    caller = threading.Thread(target=call)
    caller.start()
    while caller.is_alive():
        peak[0] = max(peak[0], sandbox_threads_of(daemon, api, user))
        caller.join(0.5)
    condemned = time.monotonic()
    while daemon.containers(api, **{"org.sandboxd.user": user}) and time.monotonic() - condemned < 120:
        time.sleep(0.1)
    return {"status": answer[0]["status"] if answer else "no answer", "threads": peak[0],
            "gone_s": time.monotonic() - condemned}


def run(daemon: Daemon, api: Any, per_run: int, batch: int, bomb_s: float) -> list[dict[str, Any]]:
    kills: list[dict[str, Any]] = []
    for start in range(0, per_run, batch):
        users = USERS[: min(batch, per_run - start)]
        with ThreadPoolExecutor(len(users)) as pool:
            kills += pool.map(lambda user: one_kill(daemon, api, user, bomb_s), users)
    return kills


def distribution(kills: list[dict[str, Any]], log_path: Path) -> str:
    """Every kill's time, in percentiles, and how many were of a Sentry that had died by itself (the daemon's log)."""
    gone = sorted(kill["gone_s"] for kill in kills)
    at = [gone[min(len(gone) - 1, int(len(gone) * share))] for share in (0.5, 0.9, 0.99)]
    self_died = log_path.read_text().count('"sandbox_sentry_not_seen"')
    statuses = {status: sum(kill["status"] == status for kill in kills) for status in sorted({kill["status"] for kill in kills})}
    return (f"all {len(gone)} kills: p50 {at[0]:.1f} s, p90 {at[1]:.1f} s, p99 {at[2]:.1f} s, max {gone[-1]:.1f} s; "
            f"over {GONE_WITHIN_S} s: {sum(g > GONE_WITHIN_S for g in gone)}; statuses {statuses}; "
            f"Sentries found dead at their kill (sandbox_sentry_not_seen): {self_died}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=20)
    parser.add_argument("--per-run", type=int, default=20)
    parser.add_argument("--batch", type=int, default=10, help="sandboxes bombed at once")
    parser.add_argument("--bomb-s", type=float, default=15.0, help="the call's timeout: how long each bomb spreads")
    parser.add_argument("--pids-limit", type=int, default=1500, help="each sandbox's (gVisor adds 256 host threads)")
    args = parser.parse_args(argv)
    api = docker.from_env()
    daemon = Daemon(Path(tempfile.mkdtemp(prefix="stress-kill-")), config=config(args.batch, args.pids_limit))
    write_tool(daemon.data / "tools", "bomber", BOMB, inputs=INPUTS)
    daemon.start()
    worst: list[float] = []
    every: list[dict[str, Any]] = []
    try:
        for number in range(1, args.runs + 1):
            kills = run(daemon, api, args.per_run, args.batch, args.bomb_s)
            every += kills
            gone = sorted(kill["gone_s"] for kill in kills)
            late = [kill for kill in kills if kill["gone_s"] > GONE_WITHIN_S]
            worst.append(gone[-1])
            print(f"run {number}: {len(kills)} kills, gone after median {gone[len(gone) // 2]:.1f} s, max {gone[-1]:.1f} s; "
                  f"threads at most {max(kill['threads'] for kill in kills)}; statuses "
                  f"{sorted({kill['status'] for kill in kills})}; over {GONE_WITHIN_S} s: {len(late)}", flush=True)
    finally:
        daemon.stop()
        daemon.remove_leftovers(api)
    print(f"{RUNTIME or 'runc'}: {args.runs} runs of {args.per_run}, the slowest kill {max(worst):.1f} s "
          f"(limit {GONE_WITHIN_S} s)")
    print(distribution(every, daemon.log_path))
    if max(worst) <= GONE_WITHIN_S:
        shutil.rmtree(daemon.tmp, ignore_errors=True)
        return 0
    print(f"the daemon's log, for the slow ones: {daemon.log_path}")
    return 1


if __name__ == "__main__":
    sys.exit(main())
