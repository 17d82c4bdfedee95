"""The table (Markdown, so it pastes into docs/performance.md), the machine, and the JSON."""

from __future__ import annotations

import json
import os
import platform
import shutil
import subprocess
import time
from pathlib import Path
from typing import Any

from bench.stats import ratio


def machine_info(api: Any) -> dict[str, Any]:
    info: dict[str, Any] = {"nproc": os.cpu_count(), "kernel": platform.release(), "python": platform.python_version()}
    try:
        with open("/proc/cpuinfo") as f:
            info["cpu"] = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), "?")
    except OSError:
        info["cpu"] = "?"
    try:
        with open("/proc/meminfo") as f:
            info["memory_gb"] = round(int(f.readline().split()[1]) / 2**20, 1)
    except OSError:
        pass
    try:
        engine = api.info()
        info["docker"] = api.version().get("Version")
        info["cgroup"] = engine.get("CgroupVersion")
        info["cgroup_driver"] = engine.get("CgroupDriver")
        info["storage_driver"] = engine.get("Driver")
        info["runtime"] = engine.get("DefaultRuntime")
    except Exception as exc:  # the table is still useful without it
        info["docker_error"] = str(exc)
    node = shutil.which("node")
    if node:
        info["node_host"] = subprocess.run([node, "--version"], capture_output=True, text=True).stdout.strip()
    return info


def _ms(value: float | None) -> str:
    if value is None:
        return "—"
    return f"{value:.3f} ms" if value < 10 else f"{value:.0f} ms" if value >= 100 else f"{value:.1f} ms"


def _x(value: float | None) -> str:
    return "—" if value is None else f"{value:.2f}×" if value < 10 else f"{value:,.0f}×"


def _check(ok: bool | None) -> str:
    return "—" if ok is None else "yes" if ok else "**no**"


def rows(r: dict[str, Any]) -> list[tuple[str, str, str, str, str, str]]:
    """(figure, sandboxd, floor or alternative, ratio, target, met) for every measured figure."""
    f, d = r.get("floors", {}), r.get("daemon", {})
    out: list[tuple[str, str, str, str, str, str]] = []
    # The floors sampled between the daemon's own rounds when there are (the same machine state), else the floors section's.
    attach = d.get("warm_floor") or f.get("attach", {})
    warm = d.get("warm", {})
    if warm:
        p50 = ratio(warm.get("p50_ms"), attach.get("p50_ms"))
        out.append(("warm hello call, p50", _ms(warm.get("p50_ms")), f"raw attach echo {_ms(attach.get('p50_ms'))}",
                    _x(p50), "≤ 2.5× floor", _check(p50 is not None and p50 <= 2.5)))
        out.append(("warm hello call, p99", _ms(warm.get("p99_ms")), f"raw attach echo {_ms(attach.get('p99_ms'))}",
                    _x(ratio(warm.get("p99_ms"), attach.get("p99_ms"))), "≤ 2 ms", _check(warm.get("p99_ms", 1e9) <= 2.0)))
        out.append(("warm hello call, p99.9", _ms(warm.get("p999_ms")), f"raw attach echo {_ms(attach.get('p999_ms'))}",
                    _x(ratio(warm.get("p999_ms"), attach.get("p999_ms"))), "", "—"))
        plain = d.get("plain_warm", {})
        if plain:
            x = ratio(plain.get("p50_ms"), attach.get("p50_ms"))
            out.append(("… the same call through sandboxd.client (a plain client: encoded per call), p50",
                        _ms(plain.get("p50_ms")), f"raw attach echo {_ms(attach.get('p50_ms'))}", _x(x), "≤ 2× floor",
                        _check(x is not None and x <= 2)))
            out.append(("… and its p99", _ms(plain.get("p99_ms")), f"raw attach echo {_ms(attach.get('p99_ms'))}",
                        _x(ratio(plain.get("p99_ms"), attach.get("p99_ms"))), "", "—"))
        node_warm = d.get("node_warm", {})
        if node_warm:
            # What a pi session sees: the same calls through the TypeScript client (clients/pi uses it).
            out.append(("… the same call through @sandboxd/client from Node (pi's path), p50", _ms(node_warm.get("p50_ms")),
                        f"raw attach echo {_ms(attach.get('p50_ms'))}; Python client {_ms(warm.get('p50_ms'))}",
                        _x(ratio(node_warm.get("p50_ms"), attach.get("p50_ms"))), "", "—"))
            out.append(("… and its p99", _ms(node_warm.get("p99_ms")),
                        f"raw attach echo {_ms(attach.get('p99_ms'))}; Python client {_ms(warm.get('p99_ms'))}",
                        _x(ratio(node_warm.get("p99_ms"), attach.get("p99_ms"))), "", "—"))
        mcp = d.get("mcp_stdio", {})
        if mcp:
            # What an MCP host sees: the same call through `sandboxd mcp` (stdio), beside our protocol in the same rounds.
            through, direct = mcp["mcp"], mcp["protocol"]
            out.append(("… the same call through `sandboxd mcp` on stdio (MCP), p50", _ms(through.get("p50_ms")),
                        f"our protocol {_ms(direct.get('p50_ms'))}", _x(ratio(through.get("p50_ms"), direct.get("p50_ms"))),
                        "", "—"))
            out.append(("… and its p99", _ms(through.get("p99_ms")), f"our protocol {_ms(direct.get('p99_ms'))}",
                        _x(ratio(through.get("p99_ms"), direct.get("p99_ms"))), "", "—"))
            out.append(("`sandboxd mcp` CPU per warm call", f"{through['server_cpu_us_per_call']:.0f} µs", "", "", "", "—"))
        shim = f.get("shim_attach", {})
        if shim:
            out.append(("… the same hello over a raw attach to the shim (no daemon), p50", _ms(shim.get("p50_ms")),
                        f"raw attach echo {_ms(attach.get('p50_ms'))}", _x(ratio(shim.get("p50_ms"), attach.get("p50_ms"))),
                        "", "—"))
            out.append(("… and its p99", _ms(shim.get("p99_ms")), f"raw attach echo {_ms(attach.get('p99_ms'))}",
                        _x(ratio(shim.get("p99_ms"), attach.get("p99_ms"))), "", "—"))
        if warm.get("daemon_cpu_us_per_call") is not None:
            out.append(("daemon CPU per warm call", f"{warm['daemon_cpu_us_per_call']:.0f} µs", "", "", "", "—"))
        run = f.get("docker_run", {})
        if run.get("p50_ms"):
            speedup = ratio(run["p50_ms"], warm.get("p50_ms"))
            out.append(("warm call vs `docker run --rm` per call", _ms(warm.get("p50_ms")), f"docker run {_ms(run['p50_ms'])}",
                        f"{_x(speedup)} faster", "≥ 500× faster", _check(speedup is not None and speedup >= 500)))
        node = f.get("node_spawn", {})
        if node.get("p50_ms"):
            out.append(("warm call vs spawning `node` per call", _ms(warm.get("p50_ms")), f"node spawn {_ms(node['p50_ms'])}",
                        f"{_x(ratio(node['p50_ms'], warm.get('p50_ms')))} faster", "", "—"))
    ping = d.get("ping", {})
    if ping:
        out.append(("ping over the socket (no sandbox), p50", _ms(ping.get("p50_ms")), "", "", "", "—"))
    floor_tp = {row["clients"]: row for row in f.get("throughput", [])}
    for row in d.get("throughput", []):
        n = row["clients"]
        floor = floor_tp.get(n, {}).get("calls_per_s")
        target = "≥ 3,000/s" if n == 16 else ""
        ok = (row["calls_per_s"] >= 3000) if n == 16 else None
        out.append((f"throughput, {n} client{'s' if n > 1 else ''}", f"{row['calls_per_s']:,.0f} calls/s",
                    f"raw attach {floor:,.0f}/s" if floor else "", _x(ratio(row["calls_per_s"], floor)), target, _check(ok)))
    cold = d.get("cold", {})
    create = cold.get("floor") or f.get("create_to_reply", {})
    if cold:
        c = ratio(cold.get("p50_ms"), create.get("p50_ms"))
        out.append(("first call of a new user (cold), p50", _ms(cold.get("p50_ms")),
                    f"create→attach→start→reply {_ms(create.get('p50_ms'))}", _x(c), "≤ 1.3× floor",
                    _check(None if c is None else c <= 1.3)))  # no floor (--skip floors): nothing to judge
    listed = d.get("listed", {})
    if listed:
        # Issue 37's target: the listing warmed the user's sandbox, so the call pays only the tool's first load.
        out.append(("first call of a new user after their session's tools/list (warmed), p50", _ms(listed.get("p50_ms")),
                    f"cold first call {_ms(cold.get('p50_ms'))}", _x(ratio(listed.get("p50_ms"), cold.get("p50_ms"))),
                    "≤ 5 ms", _check(listed.get("p50_ms", 1e9) <= 5)))
    waits = [w for w in cold.get("queue_ms", []) if w is not None]
    if waits:
        out.append(("… of it waiting for the sandbox to start (daemon's queue_ms), median", _ms(sorted(waits)[len(waits) // 2]),
                    "", "", "", "—"))
    ret, paused = d.get("returning", {}), f.get("attach_after_pause", {})
    if ret:
        out.append(("first call of a returning user (warm, new connection), p50", _ms(ret.get("p50_ms")),
                    f"raw attach after the same pause {_ms(paused.get('p50_ms'))}",
                    _x(ratio(ret.get("p50_ms"), paused.get("p50_ms"))), "", "—"))
    load = d.get("tool_load", {})
    if load:
        first, second = load["first"], load["second"]
        out.append(("first call of a not-yet-loaded tool, p50", _ms(first.get("p50_ms")),
                    f"its 2nd call {_ms(second.get('p50_ms'))}", _x(ratio(first.get("p50_ms"), second.get("p50_ms"))), "", "—"))
    prog, flood = d.get("progress", {}), f.get("flood", {})
    if prog:
        out.append(("progress notifications", f"{prog['per_s']:,.0f}/s",
                    f"raw attach {flood['per_s']:,.0f}/s" if flood else "", _x(ratio(prog["per_s"], flood.get("per_s"))), "", "—"))
    mem, bare = d.get("idle_memory", {}), f.get("idle_memory", {})
    if mem.get("n"):
        out.append(("memory of an idle warm sandbox (median)", f"{mem['median_mb']:.1f} MB",
                    f"bare node echo {bare['mb']:.1f} MB" if bare else "", _x(ratio(mem["median_mb"], (bare or {}).get("mb"))),
                    "≤ 50 MB", _check(mem["max_mb"] <= 50)))
    if d.get("daemon_rss_mb") is not None:
        out.append((f"daemon memory (VmRSS, {d.get('sandboxes_at_rss', '?')} sandboxes)", f"{d['daemon_rss_mb']:.1f} MB",
                    "", "", "", "—"))
    refill = d.get("refill", {})
    if refill.get("n"):
        out.append(("refill after `docker kill` of a user's warm sandboxes, max", _ms(refill.get("max_ms")),
                    f"create→attach→start→reply {_ms(create.get('p50_ms'))}", _x(ratio(refill.get("max_ms"), create.get("p50_ms"))),
                    "≤ 1 s", _check(refill.get("max_ms", 1e9) <= 1000)))
        waited = refill.get("max_queue_ms")
        # A start takes 100+ ms; a few ms is the loop being descheduled on a busy machine.
        out.append(("longest wait for a sandbox of any call during the refills", _ms(waited),
                    f"{refill.get('calls_logged', 0)} calls logged", "", "never on a caller's path (< 10 ms)",
                    _check(None if waited is None else waited < 10 and refill.get("bystander_failures") == 0)))
        inside, base = refill.get("bystander_in_refill", {}), refill.get("bystander_baseline", {})
        out.append(("another user's calls during a refill, p99", _ms(inside.get("p99_ms")),
                    f"the same calls outside {_ms(base.get('p99_ms'))}", _x(ratio(inside.get("p99_ms"), base.get("p99_ms"))),
                    "", "—"))
    via = r.get("attach_transport", {})
    if via.get("warm"):
        w = via["warm"]
        out.append(("the same daemon over the attach transport: warm call p50", _ms(w.get("p50_ms")),
                    f"raw attach echo {_ms(attach.get('p50_ms'))}", _x(ratio(w.get("p50_ms"), attach.get("p50_ms"))), "", "—"))
        out.append(("… its p99", _ms(w.get("p99_ms")), f"raw attach echo {_ms(attach.get('p99_ms'))}",
                    _x(ratio(w.get("p99_ms"), attach.get("p99_ms"))), "", "—"))
    if via.get("throughput"):
        tp = via["throughput"]
        floor = floor_tp.get(tp["clients"], {}).get("calls_per_s")
        out.append((f"… its throughput, {tp['clients']} clients", f"{tp['calls_per_s']:,.0f} calls/s",
                    f"raw attach {floor:,.0f}/s" if floor else "", _x(ratio(tp["calls_per_s"], floor)), "", "—"))
    dense = r.get("density", {})
    alone = dense.get("alone", {})
    for row in dense.get("sizes", []):
        n, call, single = row["users"], row["call"], alone.get("call", {})
        out.append((f"{n} users each holding a warm sandbox: filling, sandboxes started per second",
                    f"{row['started_per_s']:.1f}/s", f"{dense['callers']} callers; the daemon's Docker calls on 16 threads",
                    "", "", "—"))
        rounds = f", median of {len(call['rounds'])} rounds" if call.get("rounds") else ""
        for q in ("p50", "p99"):
            x = ratio(call.get(f"{q}_ms"), single.get(f"{q}_ms"))
            out.append((f"… a warm call at {n} users, {q}{rounds}", _ms(call.get(f"{q}_ms")),
                        f"the same call with its user alone {_ms(single.get(f'{q}_ms'))}", _x(x), "≤ 1.5× alone",
                        _check(x is not None and x <= 1.5)))
        for key, what in (("status", "`sandbox/status`"), ("list", "`tools/list`")):
            out.append((f"… {what} at {n} users, p50", _ms(row[key].get("p50_ms")),
                        f"with one user {_ms(alone.get(key, {}).get('p50_ms'))}",
                        _x(ratio(row[key].get("p50_ms"), alone.get(key, {}).get("p50_ms"))), "", "—"))
        out.append((f"… daemon memory at {n} users (VmRSS, {row['sandboxes']} sandboxes)", f"{row['daemon_rss_mb']:.1f} MB",
                    f"with one user {alone.get('daemon_rss_mb', 0):.1f} MB", "", "", "—"))
    out += _neighbour_rows(r.get("neighbours", {}))
    out += _runtime_rows(r)
    out += _https_rows(r.get("https", {}))
    out += _quota_rows(r.get("quota", {}))
    out += _transfer_rows(r.get("transfer", {}))
    out += _cluster_rows(r.get("cluster", {}))
    out += _router_rows(r.get("router", {}))
    out += _email_rows(r.get("email", {}))
    out += _permissions_rows(r.get("permissions", {}))
    out += _move_rows(r.get("move", {}))
    over = r.get("overhead", {})
    if over.get("warm"):
        out.append(("sandboxd alone (fake backend, no Docker): warm call p50", _ms(over["warm"].get("p50_ms")),
                    f"daemon CPU {over['warm'].get('daemon_cpu_us_per_call', 0):.0f} µs/call", "", "", "—"))
    if over.get("throughput"):
        tp = over["throughput"]
        out.append((f"sandboxd alone (fake backend): throughput, {tp['clients']} clients", f"{tp['calls_per_s']:,.0f} calls/s",
                    f"daemon CPU {tp['cpu']['daemon_cpu_us_per_call']:.0f} µs/call", "", "", "—"))
    out += _instruction_rows(r.get("instructions", {}), r.get("machine", {}).get("cpu", "?"))
    return out


# Daemon CPU per warm call the project aims at (issue 37), by backend.
_CPU_TARGET_US = {"fake": 50, "docker": 100}


def _instruction_rows(r: dict[str, Any], cpu_model: str) -> list[tuple[str, str, str, str, str, str]]:
    """Instructions per warm call (callgrind: steady on a busy machine) and the same calls' CPU µs, each
    beside the floor's: a bare uvloop server's for the same client loop (bench/cpu_floor.py)."""
    if "skipped" in r:
        return [("instructions per warm call", "skipped", r["skipped"], "", "", "—")]
    out = []
    for path, what, server in (("fake", "fake backend: the daemon alone", "a bare uvloop server"),
                               ("docker", "Docker: through a warm sandbox", "a bare uvloop relay to a Node echo")):
        row = r.get(path)
        if row is None:
            continue
        instr, cpu = row["instructions_per_call"], row["daemon_cpu_us_per_call"]
        floor_instr, floor_cpu = row.get("floor", {}).get("instructions_per_call"), row.get("floor_cpu_us_per_call")
        out.append((f"daemon instructions per warm call ({what})", f"{instr / 1000:,.0f}k",
                    f"{server} {floor_instr / 1000:,.0f}k" if floor_instr is not None else "",
                    _x(ratio(instr, floor_instr)), "", "—"))
        target = _CPU_TARGET_US[path]
        # The floor's CPU was sampled in rounds between these calls': the same machine state, the same CPU.
        out.append(("… its daemon CPU per warm call", f"{cpu:.0f} µs{_in_kernel(row.get('daemon_system_us_per_call'))}",
                    f"{server} {floor_cpu:.0f} µs{_in_kernel(row.get('floor_system_us_per_call'))} ({cpu_model})"
                    if floor_cpu is not None else cpu_model,
                    _x(ratio(cpu, floor_cpu)), f"≤ {target} µs", _check(cpu <= target)))
    return out


def _in_kernel(system_us: float | None) -> str:
    """The system part of a CPU figure, as the report shows it (runs before it was recorded have none)."""
    return "" if system_us is None else f" ({system_us:.0f} in the kernel)"


def _runtime_rows(r: dict[str, Any]) -> list[tuple[str, str, str, str, str, str]]:
    """The report's rows: gVisor's figure beside runc's."""
    both = r.get("runtimes", {})
    runc, runsc = both.get("runc", {}), both.get("runsc", {})
    if "skipped" in runsc:
        return [("gVisor (runsc) beside runc", "skipped", runsc["skipped"], "", "", "—")]
    if not runc or not runsc:
        return []
    out = []
    for key, what in (("warm", "a warm call"), ("cold", "a new user's first call (a sandbox starts)")):
        for q in ("p50", "p99"):
            mine, base = runsc.get(key, {}).get(f"{q}_ms"), runc.get(key, {}).get(f"{q}_ms")
            out.append((f"gVisor (runsc, ptrace): {what}, {q}", _ms(mine), f"runc {_ms(base)}", _x(ratio(mine, base)),
                        "", "—"))
    mine, base = runsc.get("idle_memory", {}).get("median_mb"), runc.get("idle_memory", {}).get("median_mb")
    if mine is not None and base is not None:
        out.append(("gVisor (runsc, ptrace): an idle sandbox's memory (its cgroup), median", f"{mine:.1f} MB",
                    f"runc {base:.1f} MB", _x(ratio(mine, base)), "", "—"))
    return out


def _move_rows(m: dict[str, Any]) -> list[tuple[str, str, str, str, str, str]]:
    """`sandboxd users move` between two real hosts over mutual TLS, btrfs to btrfs (bench/move.py)."""
    if "skipped" in m:
        return [("users move", "skipped", m["skipped"], "", "", "—")]
    if not m.get("move_s"):
        return []
    return [(f"users move of a {m['mib']}-MiB user ({m['files']} files), host to host over TLS",
             f"{m['move_s']:.1f} s", f"the move's own steps {m['result']['seconds']:.1f} s", "", "", "—")]


def _transfer_rows(t: dict[str, Any]) -> list[tuple[str, str, str, str, str, str]]:
    """One user exported from a btrfs filesystem and imported into another, through a pipe (bench/transfer.py)."""
    if "skipped" in t:
        return [("users export + import", "skipped", t["skipped"], "", "", "—")]
    if not t.get("move_s"):
        return []
    return [(f"users export + import of a {t['mib']}-MiB user ({t['files']} files), btrfs to btrfs",
             f"{t['move_s']:.1f} s", f"import alone {t['import']['seconds']:.1f} s", "", "", "—"),
            ("… what makes the export consistent: the read-only snapshot", f"{t['snapshot_ms']:.0f} ms",
             f"holding the user's calls instead {t['held_s']:.1f} s", "", "", "—")]


def _quota_rows(q: dict[str, Any]) -> list[tuple[str, str, str, str, str, str]]:
    """The disk quota, soft and hard, beside the same daemon with it off (bench/quota.py)."""
    if "skipped" in q:
        return [("disk quota (storage.enforcement)", "skipped", q["skipped"], "", "", "—")]
    off = q.get("off")
    if not off:
        return []
    out = []
    for mode in ("soft", "hard"):
        row = q.get(mode)
        if not row:
            continue
        for key, what in (("warm", "a warm call"), ("cold", "a new user's first call")):
            mine, base = row[key].get("p50_ms"), off[key].get("p50_ms")
            out.append((f"disk quota {mode}: {what}, p50", _ms(mine), f"quota off {_ms(base)}", _x(ratio(mine, base)),
                        "", "—"))
        cpu, base_cpu = row["warm"].get("daemon_cpu_us_per_call"), off["warm"].get("daemon_cpu_us_per_call")
        if cpu is not None and base_cpu is not None:
            out.append((f"disk quota {mode}: daemon CPU per warm call", f"{cpu:.0f} µs", f"quota off {base_cpu:.0f} µs",
                        "", "", "—"))
    return out


def _permissions_rows(p: dict[str, Any]) -> list[tuple[str, str, str, str, str, str]]:
    """A warm call of a tool with a permissions block against one without, same sandbox (bench/permissions.py)."""
    if not p.get("hello_declared"):
        return []
    mine, base = p["hello_declared"], p["hello_undeclared"]
    x = ratio(mine.get("p50_ms"), base.get("p50_ms"))
    return [("a warm call of a tool with a permissions block, p50 / p99",
             f"{_ms(mine.get('p50_ms'))} / {_ms(mine.get('p99_ms'))}",
             f"no block {_ms(base.get('p50_ms'))} / {_ms(base.get('p99_ms'))}", _x(x), "≤ 1.05×",
             _check(x is not None and x <= 1.05))]


def _email_rows(e: dict[str, Any]) -> list[tuple[str, str, str, str, str, str]]:
    """The email database's access per tool, each access its own warm sandbox (bench/email.py)."""
    if not e.get("warm"):
        return []
    # Against email: write, declared too, in the read-write sandbox a tool without the block uses as well:
    # the two differ only in the sandbox they run in (the block's own cost is the permissions rows').
    warm, base = e["warm"], e["warm"]["hello_write"]
    out = []
    for access in ("none", "read"):
        mine = warm[f"hello_{access}"]
        x = ratio(mine.get("p50_ms"), base.get("p50_ms"))
        out.append((f"a warm call of a tool with email: {access}, p50 / p99",
                    f"{_ms(mine.get('p50_ms'))} / {_ms(mine.get('p99_ms'))}",
                    f"email: write {_ms(base.get('p50_ms'))} / {_ms(base.get('p99_ms'))}", _x(x), "≤ 1.05×",
                    _check(x is not None and x <= 1.05)))
    alt = e["alternating"]
    x = ratio(alt["two_in_turn"].get("p50_ms"), alt["one_access"].get("p50_ms"))
    out.append(("… two accesses called in turn (two warm sandboxes), p50", _ms(alt["two_in_turn"].get("p50_ms")),
                f"one access {_ms(alt['one_access'].get('p50_ms'))}", _x(x), "", "—"))
    second = e["second_access"]
    out.append(("… a user's first call of a second access (a start), p50", _ms(second["first_of_second_access"].get("p50_ms")),
                f"their warm call {_ms(second['warm'].get('p50_ms'))}", "", "", "—"))
    return out


def _router_rows(r: dict[str, Any]) -> list[tuple[str, str, str, str, str, str]]:
    """A warm call through `sandboxd router` beside the same call to its host directly (bench/router.py)."""
    if "skipped" in r:
        return [("a warm call through the router", "skipped", r["skipped"], "", "", "—")]
    if not r.get("router"):
        return []
    out = []
    for q, goal in (("p50", 1.5), ("p99", None)):
        mine, base = r["router"].get(f"{q}_ms"), r["direct"].get(f"{q}_ms")
        x = ratio(mine, base)
        out.append((f"a warm call through the router, {q}", _ms(mine), f"its host directly {_ms(base)}", _x(x),
                    f"≤ {goal}× direct" if goal else "", _check(x is not None and x <= goal) if goal else "—"))
    for q in ("p50", "p99") if r.get("tls") else ():
        mine, base = r["router"].get(f"{q}_ms"), r["tls"].get(f"{q}_ms")
        out.append((f"… the router beside its host's TLS listener, {q}", _ms(mine), f"the listener {_ms(base)}",
                    _x(ratio(mine, base)), "", "—"))
    for q in ("p50", "p99") if r.get("relay") else ():
        mine, base, direct = r["router"].get(f"{q}_ms"), r["relay"].get(f"{q}_ms"), r["direct"].get(f"{q}_ms")
        out.append((f"… the router beside a relay floor (socat: bytes only, the same TLS hop), {q}", _ms(mine),
                    f"the relay {_ms(base)} ({_x(ratio(base, direct))} direct)", _x(ratio(mine, base)), "", "—"))
    relay_cpu = r.get("relay_cpu_us_per_call")
    out.append(("… the router's CPU per call", f"{r['router_cpu_us_per_call']:.0f} µs",
                f"the relay {relay_cpu:.0f} µs" if relay_cpu else "", _x(ratio(r["router_cpu_us_per_call"], relay_cpu))
                if relay_cpu else "", "", "—"))
    spread = r.get("spread")
    if spread:
        calls, hosts = spread["calls"], ", ".join(f"{node} {n}" for node, n in spread["per_host"].items())
        out.append((f"{spread['users']} new users through the router, hosts from cold: the last answer",
                    f"{spread['last_answer_s']:.1f} s", f"first calls p50 {_ms(calls.get('p50_ms'))} / p99 "
                    f"{_ms(calls.get('p99_ms'))}; users per host {hosts}", "", "", "—"))
    return out


def _cluster_rows(c: dict[str, Any]) -> list[tuple[str, str, str, str, str, str]]:
    """A warm call with a cluster: section beside the same daemon without one (bench/cluster.py)."""
    if "skipped" in c:
        return [("a warm call with cluster: on", "skipped", c["skipped"], "", "", "—")]
    if not c.get("on"):
        return []
    out = []
    for q, goal in (("p50", 1.1), ("p99", None)):
        mine, base = c["on"].get(f"{q}_ms"), c["off"].get(f"{q}_ms")
        x = ratio(mine, base)
        out.append((f"a warm call with cluster: on, {q}", _ms(mine), f"cluster: off {_ms(base)}", _x(x),
                    f"≤ {goal}× off" if goal else "", _check(x is not None and x <= goal) if goal else "—"))
    cpu, base_cpu = c["on"]["daemon_cpu_us_per_call"], c["off"]["daemon_cpu_us_per_call"]
    out.append(("… the daemon's CPU per warm call, cluster: on", f"{cpu:.0f} µs", f"cluster: off {base_cpu:.0f} µs",
                _x(ratio(cpu, base_cpu)), "", "—"))
    return out


def _https_rows(h: dict[str, Any]) -> list[tuple[str, str, str, str, str, str]]:
    """egress.secrets' absolute-form HTTPS beside a CONNECT tunnel to the same local server (bench/egress_tls.py)."""
    tunnel, absolute = h.get("tunnel"), h.get("absolute")
    if not tunnel or not absolute:
        return []
    out = []
    for q in ("p50", "p99"):
        x = ratio(_p(h, "absolute", q), _p(h, "tunnel", q))
        out.append((f"HTTPS request from a tool, new connection each, egress.secrets host (the proxy's TLS), {q}",
                    _ms(_p(h, "absolute", q)), f"through a CONNECT tunnel {_ms(_p(h, 'tunnel', q))}", _x(x), "", "—"))
    out.append(("… the daemon's CPU per HTTPS request", f"{absolute['daemon_cpu_us_per_request']:.0f} µs",
                f"through a CONNECT tunnel {tunnel['daemon_cpu_us_per_request']:.0f} µs",
                _x(ratio(absolute["daemon_cpu_us_per_request"], tunnel["daemon_cpu_us_per_request"])), "", "—"))
    return out


_SCENARIOS = {"pool": "8 users at the pool's limit (28 of 32 slots, 6 calls each)",
              "egress": "8 sandboxes downloading at their rate", "flood": "4 sandboxes flooding refused connections",
              "dns": "1 user's 4 sandboxes asking a resolver that never answers",
              "stalled": "8 sandboxes holding 256 tunnels stalled both ways"}
# The bystander's warm call beside each, at most this many times quiet (issue 25; issue 44 for stalled tunnels).
_CALL_TARGETS = {"stalled": 2.0}


def _p(figure: dict[str, Any], key: str, q: str) -> float | None:
    return figure.get(key, {}).get(f"{q}_ms")


def _neighbour_rows(n: dict[str, Any]) -> list[tuple[str, str, str, str, str, str]]:
    """Each scenario's bystander beside the same daemon quiet just before it, with the targets of issue 25."""
    out: list[tuple[str, str, str, str, str, str]] = []
    for name, what in _SCENARIOS.items():
        loaded, quiet = n.get(name), n.get(f"{name}_quiet")
        if not loaded or not quiet:
            continue
        ping, ping_quiet = _p(loaded, "ping", "p99"), _p(quiet, "ping", "p99")
        bare = _p(loaded, "yardstick_ping", "p99")
        beside = f"; a bare server's {_ms(bare)} (quiet {_ms(_p(quiet, 'yardstick_ping', 'p99'))})" if bare is not None else ""
        out.append((f"{what}: a bystander's ping, p99", _ms(ping), f"quiet {_ms(ping_quiet)}{beside}",
                    _x(ratio(ping, ping_quiet)), "≤ 10 ms", _check(ping is not None and ping <= 10)))
        call, call_quiet = _p(loaded, "call", "p50"), _p(quiet, "call", "p50")
        x = ratio(call, call_quiet)
        cpu = f"daemon CPU {loaded['call']['daemon_cpu_us_per_call']:.0f} µs/call (quiet {quiet['call']['daemon_cpu_us_per_call']:.0f})"
        most = _CALL_TARGETS.get(name, 3.0)
        out.append(("… a warm call of the bystander, p50", _ms(call), f"quiet {_ms(call_quiet)}; {cpu}", _x(x),
                    f"≤ {most:g}× quiet", _check(x is not None and x <= most)))
        extra = {"pool": f"{loaded.get('newcomers_served', 0)} of 4 newcomers served, first calls "
                         f"{', '.join(f'{s:g} s' for s in loaded.get('newcomer_first_call_s', []))}",
                 "egress": f"{loaded.get('egress_mib_s', 0):.0f} MiB/s moved",
                 "flood": "", "dns": "",
                 "stalled": f"filled in {loaded.get('fill_s', 0):.0f} s; {loaded.get('pipe_ends', 0)} pipe ends held, "
                            f"daemon memory +{loaded.get('rss_growth_mb', 0):.0f} MB, "
                            f"{loaded.get('queued_mib', 0):.0f} MiB queued for the upstream"}[name]
        out.append(("… the daemon's CPU for the neighbours alone, log growth",
                    f"{loaded['daemon_cores']:.2f} cores, {loaded['log_kib_per_s']:.1f} KiB/s",
                    f"quiet {quiet['daemon_cores']:.2f} cores, {quiet['log_kib_per_s']:.1f} KiB/s" + (f"; {extra}" if extra else ""),
                    "", "flood ≤ 0.25 core, ≤ 51 KiB/s" if name == "flood" else "",
                    _check(loaded["daemon_cores"] <= 0.25 and loaded["log_kib_per_s"] <= 51.2)
                    if name == "flood" else "—"))
        if name == "dns":
            out.append(_lookup_row(loaded, quiet))
        if name == "pool":
            served = loaded.get("newcomer_first_call_s", [])
            out.append(("… 4 newcomers' first calls, slowest", f"{max(served):.2f} s" if served else "—", "", "",
                        "each ≤ 3 s", _check(len(served) == 4 and max(served) <= 3)))
    return out


def _lookup_row(loaded: dict[str, Any], quiet: dict[str, Any]) -> tuple[str, str, str, str, str, str]:
    """The bystander's request to a name in /etc/hosts beside a user's lookups a dead resolver holds (issue 44)."""
    lookup, lookup_quiet = _p(loaded, "lookup", "p50"), _p(quiet, "lookup", "p50")
    x, failed = ratio(lookup, lookup_quiet), loaded.get("lookups_failed", 0)
    return ("… the bystander's request to a name in /etc/hosts, p50", _ms(lookup),
            f"quiet {_ms(lookup_quiet)}; {failed} not resolved in time; the user's lookups at the resolver at once: "
            f"{loaded.get('resolver_lookups_at_once', '—')}", _x(x), "≤ 2× quiet, all resolved",
            _check(x is not None and x <= 2 and failed == 0))


def table(r: dict[str, Any]) -> str:
    lines = ["| figure | sandboxd | floor / alternative | ratio | target | met |", "| --- | ---: | --- | ---: | --- | --- |"]
    lines += ["| " + " | ".join(row) + " |" for row in rows(r)]
    return "\n".join(lines)


def cpu_table(r: dict[str, Any]) -> str:
    lines = ["| clients | calls/s | daemon CPU | client CPU | other CPU (dockerd, shims, node) | machine busy | daemon µs/call | client µs/call |",
             "| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for row in r.get("daemon", {}).get("throughput", []):
        c = row["cpu"]
        lines.append(f"| {row['clients']} | {row['calls_per_s']:,.0f} | {c['daemon_cores_used']:.2f} cores | "
                     f"{c['client_cores_used']:.2f} cores | {c['other_cores_used']:.2f} cores | {c['machine_busy_pct']:.0f}% | "
                     f"{c['daemon_cpu_us_per_call']:.0f} | {c['client_cpu_us_per_call']:.0f} |")
    for row in r.get("floors", {}).get("throughput", []):
        c = row["cpu"]
        lines.append(f"| {row['clients']} (raw attach) | {row['calls_per_s']:,.0f} | — | {c['client_cores_used']:.2f} cores | "
                     f"{c['other_cores_used']:.2f} cores | {c['machine_busy_pct']:.0f}% | — | {c['client_cpu_us_per_call']:.0f} |")
    return "\n".join(lines)


def machine_line(m: dict[str, Any]) -> str:
    return (f"{m.get('nproc')} cores ({m.get('cpu')}), {m.get('memory_gb', '?')} GB, kernel {m.get('kernel')}, "
            f"Docker {m.get('docker')} (cgroup v{m.get('cgroup')}, {m.get('cgroup_driver')}, {m.get('storage_driver')}, "
            f"{m.get('runtime')}), Python {m.get('python')}, host node {m.get('node_host', '?')}")


def write_json(r: dict[str, Any], out_dir: Path) -> Path:
    out_dir.mkdir(parents=True, exist_ok=True)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    path = out_dir / f"bench-{stamp}.json"
    text = json.dumps(r, indent=2, sort_keys=True, default=str)
    path.write_text(text)
    (out_dir / "latest.json").write_text(text)
    return path
