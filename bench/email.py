"""What the email database's per-tool access costs (docs/design.md, "The email database, per tool").

A sandbox carries one access for its life (sandbox/email_access.py), so a user whose tools
declare different accesses holds a warm sandbox for each. On one daemon, copies of hello
that differ only in their ``permissions.email``:

- a warm call of each access (none, read, write) against the same call of hello without a
  block, in rounds that alternate, so that all share the machine's state;
- calls alternating between two accesses against calls of one: each keeps its warm sandbox;
- a user's first call of a second access: one more sandbox start, against their warm call.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any, Callable

from bench import daemon as d
from bench.load import daemon_call_line
from bench.stats import summarize

REPO = Path(__file__).resolve().parents[1]
# Each tool and its permissions.email (None: no permissions block, today's read-write sandbox).
TOOLS: dict[str, str | None] = {"hello_undeclared": None, "hello_none": "none",
                                "hello_read": "read", "hello_write": "write"}
ROUNDS = 5


def write_tools(tools: Path) -> None:
    """Copies of the seed hello, each with its own name and permissions."""
    source = REPO / "seed" / "tools" / "hello"
    for name, permissions in TOOLS.items():
        folder = tools / name
        shutil.copytree(source, folder, dirs_exist_ok=True)
        head = (f"---\nname: {name}\ndescription: hello, its email access {permissions or 'undeclared'}.\nversion: 1\n"
                "inputs:\n  name:\n    type: string\n    description: Who to greet.\n")
        block = "" if permissions is None else f"permissions:\n  email: {permissions}\n"
        (folder / "TOOL.md").write_text(f"{head}{block}---\n\n# {name}\n")


def email_cost(root: Path, run_id: str, image: str, *, calls: int, samples: int,
               say: Callable[[str], None]) -> dict[str, Any]:
    config = f"pool:\n  max_total: {2 * samples + 8}\n  min_idle: 0\nsandbox:\n  image: {image}\n"
    daemon = d.BenchDaemon(root, config, fresh_tools=0)
    write_tools(daemon.data / "tools")
    daemon.start()
    try:
        user = f"email-{run_id}@bench.example"
        say(f"email access: warm calls of each access ({calls} each), then alternating")
        out: dict[str, Any] = {"warm": _warm_by_access(daemon, user, calls)}
        out["alternating"] = _alternating(daemon, user, calls)
        say(f"email access: a user's first call of a second access ({samples} users)")
        out["second_access"] = _second_access(daemon, [f"email{i}-{run_id}@bench.example" for i in range(samples)])
        return out
    finally:
        daemon.stop()


def _warm_by_access(daemon: d.BenchDaemon, user: str, calls: int) -> dict[str, Any]:
    """Each tool's warm calls, in ROUNDS rounds taking turns, after a warm-up of each."""
    conn = daemon.connect()
    try:
        templates = {name: daemon_call_line(user, name) for name in TOOLS}
        for template in templates.values():
            d.sequential_calls(conn, template, 200)
        daemon.settle()
        samples: dict[str, list[float]] = {name: [] for name in TOOLS}
        chunk = max(1, calls // ROUNDS)
        for _ in range(ROUNDS):
            for name, template in templates.items():
                samples[name] += d.sequential_calls(conn, template, chunk)
        return {name: summarize(seconds) for name, seconds in samples.items()}
    finally:
        conn.close()


def _alternating(daemon: d.BenchDaemon, user: str, calls: int) -> dict[str, Any]:
    """hello_none and hello_write called in turn, against hello_none alone: each keeps its own sandbox."""
    conn = daemon.connect()
    try:
        one = daemon_call_line(user, "hello_none")
        other = daemon_call_line(user, "hello_write")
        alone: list[float] = []
        turns: list[float] = []
        chunk = max(2, calls // ROUNDS)
        for _ in range(ROUNDS):
            alone += d.sequential_calls(conn, one, chunk)
            for i in range(chunk // 2):
                turns += d.sequential_calls(conn, one, 1) + d.sequential_calls(conn, other, 1)
        return {"one_access": summarize(alone), "two_in_turn": summarize(turns),
                "sandboxes": daemon.status()["pool"]["users"][user]}
    finally:
        conn.close()


def _second_access(daemon: d.BenchDaemon, users: list[str]) -> dict[str, Any]:
    """Per user: a first call (a start), warm calls, then the first call of another access (a start again)."""
    conn = daemon.connect()
    first: list[float] = []
    warm: list[float] = []
    try:
        for user in users:
            undeclared = daemon_call_line(user, "hello_undeclared")
            d.sequential_calls(conn, undeclared, 1)
            warm += d.sequential_calls(conn, undeclared, 20)
            daemon.settle()
            first += d.sequential_calls(conn, daemon_call_line(user, "hello_none"), 1)
        return {"first_of_second_access": summarize(first), "warm": summarize(warm)}
    finally:
        conn.close()
