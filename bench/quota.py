"""What the disk quota costs a call (docs/performance.md): the same daemon with storage.enforcement
off, soft and hard, each on a btrfs filesystem of its own with quota enabled (a loop device,
always taken down), so that only the enforcement differs.

- a warm call: the admission check, and the walk of the user's folders after the call (in a
  thread, off the caller's path; its CPU is the daemon's);
- a new user's first call: hard mode makes the user's two subvolumes and their qgroup on it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

from bench import daemon as d
from tests.loopfs import loop_devices_usable, loop_filesystem

MODES = ("off", "soft", "hard")


def quota_cost(root: Path, run_id: str, image: str, *, calls: int, samples: int,
               say: Callable[[str], None]) -> dict[str, Any]:
    problem = loop_devices_usable("btrfs")
    if problem is not None:
        return {"skipped": problem}
    out: dict[str, Any] = {}
    for mode in MODES:
        say(f"disk quota {mode}: warm calls ({calls}) and new users' first calls ({samples})")
        home = root / mode
        with loop_filesystem(home / "data", "btrfs", 1024):
            config = (f"pool:\n  max_total: {samples + 8}\n  min_idle: 0\nsandbox:\n  image: {image}\n"
                      f"storage:\n  enforcement: {mode}\n")
            daemon = d.BenchDaemon(home, config, fresh_tools=0)
            daemon.start()
            try:
                out[mode] = {
                    "warm": d.warm_latency(daemon, f"quota-{mode}-{run_id}@bench.example", calls, warmup=200),
                    "cold": d.cold_first_call(daemon, [f"quota-{mode}{i}-{run_id}@bench.example" for i in range(samples)]),
                    "enforcement": daemon.status()["storage"]["enforcement"],
                }
            finally:
                daemon.stop()
    return out
