"""Counting a process's instructions with valgrind's callgrind, over a window of calls.

perf's counters are not exposed in most VMs; callgrind counts the instructions a process runs
in user space (not the kernel's work for its system calls). The process runs under
``callgrind_prefix``; ``counted_window`` has it dump its count just before and just after the
calls, and again after as many seconds of quiet, so that what it does meanwhile while idle is
taken out by ``per_call_counts``. Used for the daemon (bench/instructions.py) and its floor
(bench/cpu_floor.py), so that both are counted the same way.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import time
from pathlib import Path
from typing import Any, Callable

_SUMMARY = re.compile(rb"^summary:\s+(\d+)", re.M)
_TRIGGER = re.compile(rb"^desc: Trigger: (.*)$", re.M)


def available() -> str | None:
    """Why instructions cannot be counted here, or None if they can."""
    missing = [tool for tool in ("valgrind", "callgrind_control") if shutil.which(tool) is None]
    return f"{' and '.join(missing)} not found: apt-get install valgrind" if missing else None


def callgrind_prefix(out_dir: Path) -> list[str]:
    """The command prefix that runs a process under callgrind, its dumps written into ``out_dir``."""
    return ["valgrind", "--tool=callgrind", f"--callgrind-out-file={out_dir}/callgrind.out", "--dump-instr=no"]


def counted_window(pid: int, run: Callable[[], Any]) -> float:
    """Dump ``pid``'s count just before and just after ``run()``, and again after as many seconds of
    quiet (the idle cost, taken out by ``per_call_counts``); the window's seconds."""
    _dump(pid, "before")
    started = time.monotonic()
    run()
    window_s = time.monotonic() - started
    _dump(pid, "calls")
    time.sleep(window_s)
    _dump(pid, "idle")
    return window_s


def per_call_counts(out_dir: Path, calls: int, window_s: float) -> dict[str, Any]:
    """Instructions per call of the window ``counted_window`` dumped into ``out_dir`` (then removed)."""
    counts = _dumps(out_dir)
    shutil.rmtree(out_dir, ignore_errors=True)
    if "calls" not in counts or "idle" not in counts:
        raise RuntimeError(f"callgrind wrote no dumps for the window (found {sorted(counts)}); is vgdb usable here?")
    return {"calls": calls, "instructions_per_call": (counts["calls"] - counts["idle"]) / calls,
            "idle_instructions_per_call": counts["idle"] / calls, "window_s": window_s}


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
