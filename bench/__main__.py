"""`python -m bench` (make bench): measure the daemon and its floors in one run, print a table, write JSON.

    python -m bench            # the full run, about 2-3 minutes on 2 cores
    python -m bench --quick    # smaller samples, under a minute
    python -m bench --skip floors,throughput --profile bench-results/profile
    python -m bench --quick --only instructions   # instructions per warm call (valgrind), fake and Docker

Order: the floors first (bare echo containers, then removed), then one daemon
for every daemon figure. Every container the run makes carries a label and is
removed at the end, also after a failure.
"""

from __future__ import annotations

import argparse
import secrets
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import docker

from bench import daemon as d
from bench import floors as f
from bench import instructions
from bench import report
from bench.daemon import REPO
from bench.load import throughput
from bench.egress_tls import secrets_over_https
from bench.email import email_cost
from bench.permissions import permissions_cost
from bench.neighbours import noisy_neighbours
from bench.cluster import cluster_cost
from bench.quota import quota_cost
from bench.router import router_cost
from bench.transfer import transfer_cost
from bench.move import move_cost
from bench.runtimes import compare_runtimes
from sandboxd.config import RUNNER_IMAGE, SandboxConfig
from sandboxd.server.server import instance_id

SECTIONS = ("floors", "latency", "node", "mcp", "throughput", "progress", "tool_load", "returning", "cold", "memory",
            "refill", "density", "attach", "overhead", "neighbours", "https", "gvisor", "quota", "cluster", "router", "email", "permissions", "transfer", "move",
            "instructions")
# The sections measured on the main benchmark daemon: without any of them, it is not started.
DAEMON_SECTIONS = ("latency", "node", "mcp", "throughput", "progress", "tool_load", "returning", "cold", "memory", "refill")
WARM_ROUNDS = 5  # warm calls and their attach floor alternate this many times
DENSITY_CALLERS = 8  # first calls in flight while filling (the daemon runs its Docker calls on 16 threads)
BENCH_CONFIG = """\
# Written by `python -m bench`. Defaults everywhere, except room for every benchmark user's sandboxes.
pool:
  max_total: 64
"""


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench", description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="smaller samples (under a minute)")
    p.add_argument("--calls", type=int, help="warm sequential calls for the latency percentiles (default 10000; quick 2000)")
    p.add_argument("--duration", type=float, help="seconds per throughput window (default 5; quick 2)")
    p.add_argument("--clients", default="1,4,16", help="concurrent clients of the throughput runs (default 1,4,16)")
    p.add_argument("--samples", type=int, help="cold calls, refills, returning users, fresh tools (default 5; quick 3)")
    p.add_argument("--density", default=None,
                   help="users each holding a warm sandbox, filled in turn (default 100,500; quick 50)")
    p.add_argument("--skip", default="", help=f"comma-separated sections to leave out: {', '.join(SECTIONS)}")
    p.add_argument("--only", default="", help="comma-separated sections to run, the rest left out (e.g. instructions)")
    p.add_argument("--profile", type=Path, metavar="DIR",
                   help="record the daemon with py-spy during the warm-latency run (needs `pip install py-spy`)")
    p.add_argument("--out", type=Path, default=Path("bench-results"), help="where the JSON goes (default bench-results/)")
    p.add_argument("--image", default=RUNNER_IMAGE, help=f"runner image (default {RUNNER_IMAGE})")
    args = p.parse_args(argv)
    args.calls = args.calls or (2000 if args.quick else 10000)
    args.duration = args.duration or (2.0 if args.quick else 5.0)
    args.samples = args.samples or (3 if args.quick else 5)
    try:
        args.density = sorted({int(x) for x in (args.density or ("50" if args.quick else "100,500")).split(",") if x.strip()})
    except ValueError:
        p.error(f"--density takes numbers like 100,500, not {args.density!r}")
    try:
        args.clients = [int(x) for x in args.clients.split(",") if x.strip()]
    except ValueError:
        p.error(f"--clients takes numbers like 1,4,16, not {args.clients!r}")
    args.skip = {s.strip() for s in args.skip.split(",") if s.strip()}
    only = {s.strip() for s in args.only.split(",") if s.strip()}
    for option, named in (("--skip", args.skip), ("--only", only)):
        unknown = named - set(SECTIONS)
        if unknown:
            p.error(f"{option}: unknown section(s) {', '.join(sorted(unknown))}; the sections are {', '.join(SECTIONS)}")
    if only:
        args.skip |= set(SECTIONS) - only
    return args


def say(message: str) -> None:
    print(f"[bench {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def _pause(args: argparse.Namespace) -> float:
    """Quiet before each returning user's call (and its floor)."""
    return 0.5 if args.quick else 1.0


def run_floors(api: Any, cfg: SandboxConfig, run_id: str, args: argparse.Namespace) -> dict[str, Any]:
    out: dict[str, Any] = {}
    containers = f.FloorContainers(api, cfg, run_id)
    try:
        say(f"floor: raw attach round trip to a bare node echo container ({args.calls} calls)")
        out["attach"], cid = f.attach_floor(containers, args.calls, warmup=500)
        time.sleep(1.0)
        out["idle_memory"] = d.container_memory(cid)
        say(f"floor: hello over a raw attach to the image's own shim, no daemon ({args.calls} calls)")
        out["shim_attach"] = f.shim_round_trip(containers, REPO / "seed" / "tools", args.calls, warmup=500)
        if "returning" not in args.skip:
            say(f"floor: the first raw attach round trip after {_pause(args):g} s of quiet ({args.samples}×)")
            out["attach_after_pause"] = f.attach_after_pause(containers, cid, args.samples, _pause(args))
        say("floor: progress lines through a raw attach")
        out["flood"] = f.attach_flood(containers, cid, 5000 if args.quick else 20000)
        containers.remove(cid)
        if "throughput" not in args.skip:
            out["throughput"] = []
            for n in args.clients:
                say(f"floor: raw attach throughput, {n} clients on {n} containers")
                ids = containers.started(n)
                out["throughput"].append(throughput("attach", [(cid, "") for cid in ids], duration=args.duration, warmup=200))
                for cid in ids:
                    containers.remove(cid)
        say(f"floor: docker create → attach → start → first reply ({args.samples}×)")
        out["create_to_reply"] = f.create_to_first_reply(containers, args.samples)
        say(f"alternative: docker run --rm per call ({args.samples * 2}×)")
        out["docker_run"] = f.docker_run_per_call(cfg, args.samples * 2, run_id)
        say(f"alternative: spawn node per call ({args.samples * 4}×)")
        out["node_spawn"] = f.node_per_call(args.samples * 4)
    finally:
        containers.close()
    return out


def run_daemon(api: Any, cfg: SandboxConfig, root: Path, run_id: str, args: argparse.Namespace) -> dict[str, Any]:
    out: dict[str, Any] = {}
    # The floors the daemon's warm and cold figures are compared with, sampled between them.
    floors = None if "floors" in args.skip else f.FloorContainers(api, cfg, run_id)
    echo = None if floors is None else f.EchoSession(floors)
    daemon = d.BenchDaemon(root, BENCH_CONFIG + f"sandbox:\n  image: {args.image}\n", fresh_tools=args.samples * 2)
    say(f"starting sandboxd (data {daemon.data}, log {daemon.log_path})")
    daemon.start()
    from sandboxd.config import load_config

    instance = instance_id(load_config(overrides={"socket": daemon.socket, "data_path": daemon.data}, environ={}))
    user = lambda tag: f"{tag}-{run_id}@bench.example"  # noqa: E731 - one place that names the users
    try:
        out["ping"] = d.ping_latency(daemon, min(args.calls, 5000))
        if "latency" not in args.skip:
            with_floor = "" if echo is None else " alternating with the raw attach floor's"
            say(f"warm hello latency, pre-encoded and through sandboxd.client ({args.calls} sequential calls each, "
                f"in {WARM_ROUNDS} rounds{with_floor})")
            profiler = _start_profiler(daemon.pid, args.profile)
            rounds = d.warm_rounds(daemon, user("warm"), echo.round_trips if echo is not None else None, args.calls,
                                   warmup=500, rounds=WARM_ROUNDS)
            _stop_profiler(profiler)
            out["warm"], out["plain_warm"], out["warm_floor"] = rounds["warm"], rounds["plain_warm"], rounds["floor"]
        if "node" not in args.skip:
            say(f"warm hello latency through @sandboxd/client from Node ({args.calls} sequential calls)")
            out["node_warm"] = d.node_client_latency(daemon, user("warm"), args.calls, warmup=500)
        if "mcp" not in args.skip:
            say(f"warm hello latency through sandboxd mcp on stdio, beside our protocol ({args.calls // 2} calls each)")
            out["mcp_stdio"] = d.mcp_stdio_latency(daemon, user("warm"), args.calls // 2, warmup=200)
        if "throughput" not in args.skip:
            out["throughput"] = []
            for n in args.clients:
                users = min(n, 4)  # at most max_per_user (4) concurrent calls per user
                say(f"throughput, {n} clients ({users} users)")
                targets = [(str(daemon.socket), user(f"tp{n}-{i % users}")) for i in range(n)]
                out["throughput"].append(throughput("daemon", targets, duration=args.duration, warmup=200,
                                                    daemon_pid=daemon.pid))
                daemon.settle()
        if "progress" not in args.skip:
            say("progress notifications")
            out["progress"] = d.progress_rate(daemon, user("progress"), 5000 if args.quick else 20000, runs=2)
        if "tool_load" not in args.skip:
            say(f"first call of a not-yet-loaded tool ({len(daemon.fresh_tools)} tools)")
            out["tool_load"] = d.tool_first_call(daemon, user("load"))
        if "returning" not in args.skip:
            say(f"returning user ({args.samples} calls, {_pause(args):g} s apart)")
            d.returning_user(daemon, user("back"), 1, 0)  # its cold first call, not counted
            daemon.settle()
            out["returning"] = d.returning_user(daemon, user("back"), args.samples, _pause(args))
        if "cold" not in args.skip:
            say(f"first call of a new user ({args.samples} users, each after a create→reply floor sample)")
            out["cold"] = d.cold_first_call(daemon, [user(f"cold{i}") for i in range(args.samples)],
                                            echo.create_to_reply if echo is not None else None)
            say(f"first call of a new user after their session's tools/list ({args.samples} users)")
            out["listed"] = d.listed_first_call(daemon, [user(f"listed{i}") for i in range(args.samples)])
        if "memory" not in args.skip:
            say("memory of idle sandboxes and of the daemon")
            out["idle_memory"] = d.idle_sandbox_memory(daemon, api, instance)
            out["daemon_rss_mb"] = d.process_rss_mb(daemon.pid)
            out["sandboxes_at_rss"] = daemon.status()["pool"]["totals"]["idle"]
        if "refill" not in args.skip:
            say(f"refill after docker kill ({args.samples}×)")
            min_idle = daemon.status()["limits"]["minIdle"]
            out["refill"] = d.refill_after_kill(daemon, api, instance, user("refill"), user("bystander"),
                                                args.samples, min_idle)
        out["status"] = daemon.status()
    except BaseException:
        say(f"failed; the daemon's log ends with:\n{daemon.log_tail()}")
        raise
    finally:
        if echo is not None:
            echo.close()
        if floors is not None:
            floors.close()
        code = daemon.stop()
        leftovers = api.containers(all=True, filters={"label": f"org.sandboxd.instance={instance}"})
        for container in leftovers:
            api.remove_container(container["Id"], force=True)
        out["daemon_exit_code"] = code
        out["containers_left_behind"] = len(leftovers)
    return out


def run_density(root: Path, run_id: str, args: argparse.Namespace) -> dict[str, Any]:
    """A daemon of its own whose pool holds one warm sandbox for each of many users."""
    # One sandbox per user (min_idle 0); the probe user's sandbox serves every measurement, so it is
    # not recycled after max_calls_per_sandbox meanwhile (a replacement would start on a call's path).
    config = (f"pool:\n  max_total: {max(args.density) + 8}\n  min_idle: 0\n  idle_ttl_s: 3600\n"
              f"  max_calls_per_sandbox: 1000000\nsandbox:\n  image: {args.image}\n")
    daemon = d.BenchDaemon(root, config, fresh_tools=0)
    daemon.start()
    from sandboxd.config import load_config

    instance = instance_id(load_config(overrides={"socket": daemon.socket, "data_path": daemon.data}, environ={}))
    try:
        return d.density(daemon, run_id, args.density, DENSITY_CALLERS, args.calls)
    except BaseException:
        say(f"failed; the daemon's log ends with:\n{daemon.log_tail()}")
        raise
    finally:
        daemon.stop(timeout=300)
        for container in api_client().containers(all=True, filters={"label": f"org.sandboxd.instance={instance}"}):
            api_client().remove_container(container["Id"], force=True)


def api_client() -> Any:
    return docker.APIClient(version="auto", timeout=120)


def run_variant(root: Path, run_id: str, args: argparse.Namespace, config: str, tag: str) -> dict[str, Any]:
    """Warm latency and the largest throughput run of a daemon configured otherwise."""
    out: dict[str, Any] = {}
    daemon = d.BenchDaemon(root, BENCH_CONFIG + config, fresh_tools=0)
    daemon.start()
    try:
        out["warm"] = d.warm_latency(daemon, f"{tag}-{run_id}@bench.example", args.calls, warmup=500)
        if "throughput" not in args.skip:
            n = max(args.clients)
            targets = [(str(daemon.socket), f"{tag}{i % 4}-{run_id}@bench.example") for i in range(n)]
            out["throughput"] = throughput("daemon", targets, duration=args.duration, warmup=200, daemon_pid=daemon.pid)
    finally:
        daemon.stop()
    return out


def background_load(seconds: float = 1.0) -> float:
    """How busy the machine is before the run starts (%): other work skews every figure."""
    from bench.load import _machine_busy

    busy0, total0 = _machine_busy()
    time.sleep(seconds)
    busy1, total1 = _machine_busy()
    return 100 * (busy1 - busy0) / ((total1 - total0) or 1)


def _start_profiler(pid: int, directory: Path | None) -> subprocess.Popen[bytes] | None:
    if directory is None:
        return None
    py_spy = shutil.which("py-spy")
    if py_spy is None:
        say("--profile: py-spy is not installed (pip install py-spy); not profiling")
        return None
    directory.mkdir(parents=True, exist_ok=True)
    target = directory / f"daemon-{time.strftime('%Y%m%d-%H%M%S')}.txt"
    say(f"profiling the daemon with py-spy → {target}")
    proc = subprocess.Popen([py_spy, "record", "--pid", str(pid), "--rate", "1000", "--format", "raw",
                             "--output", str(target), "--nonblocking"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    time.sleep(1.0)  # py-spy attaches
    return proc


def _stop_profiler(proc: subprocess.Popen[bytes] | None) -> None:
    if proc is not None:
        proc.send_signal(2)  # SIGINT: py-spy writes its output and exits
        proc.wait(timeout=30)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    api = docker.APIClient(version="auto", timeout=120)
    try:
        api.inspect_image(args.image)
    except docker.errors.ImageNotFound:
        print(f"the runner image {args.image} is missing: build it with `make image`", file=sys.stderr)
        return 2
    cfg = SandboxConfig(image=args.image, network="none")
    run_id = secrets.token_hex(3)
    results: dict[str, Any] = {
        "run_id": run_id, "when": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "machine": report.machine_info(api),
        "args": {k: (sorted(v) if isinstance(v, set) else str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "sandbox_flags": cfg.model_dump(),
    }
    started = time.monotonic()
    results["background_busy_pct"] = background_load()
    if results["background_busy_pct"] > 15:
        say(f"the machine is already {results['background_busy_pct']:.0f}% busy: expect slower, noisier figures")
    root = Path(tempfile.mkdtemp(prefix="sandboxd-bench-"))
    try:
        if "floors" not in args.skip:
            results["floors"] = run_floors(api, cfg, run_id, args)
        if not set(DAEMON_SECTIONS) <= args.skip:
            results["daemon"] = run_daemon(api, cfg, root / "docker", run_id, args)
        if "attach" not in args.skip:
            say("the same daemon over the attach transport (sandbox.transport: attach)")
            results["attach_transport"] = run_variant(
                root / "attach", run_id, args, f"sandbox:\n  image: {args.image}\n  transport: attach\n", "attach")
        if "density" not in args.skip:
            say(f"density: {', '.join(map(str, args.density))} users each holding a warm sandbox "
                f"({DENSITY_CALLERS} callers filling)")
            results["density"] = run_density(root / "density", run_id, args)
        if "neighbours" not in args.skip:
            say("noisy neighbours: a bystander beside eight users at the pool's limit, eight sandboxes downloading, "
                "four flooding refused connections, eight holding tunnels stalled both ways, and one user's four asking "
                "a dead resolver")
            results["neighbours"] = noisy_neighbours(root / "neighbours", run_id, args.image)
        if "https" not in args.skip:
            requests = 200 if args.quick else 1000
            say(f"egress.secrets over HTTPS: {requests} requests in absolute form (the proxy's TLS) and "
                f"{requests} through CONNECT tunnels, alternating")
            results["https"] = secrets_over_https(root / "https", run_id, args.image, requests)
        if "gvisor" not in args.skip:
            say("gVisor (runsc) beside runc: warm and cold calls, idle memory")
            results["runtimes"] = compare_runtimes(api, root / "runtimes", run_id, args.image,
                                                   calls=min(args.calls, 2000), samples=args.samples, say=say)
        if "cluster" not in args.skip:
            results["cluster"] = cluster_cost(root / "cluster", run_id, args.image, calls=min(args.calls, 2000), say=say)
        if "quota" not in args.skip:
            results["quota"] = quota_cost(root / "quota", run_id, args.image, calls=min(args.calls, 2000),
                                          samples=args.samples, say=say)
        if "email" not in args.skip:
            results["email"] = email_cost(root / "email", run_id, args.image, calls=min(args.calls, 2000),
                                          samples=args.samples, say=say)
        if "permissions" not in args.skip:
            results["permissions"] = permissions_cost(root / "permissions", run_id, args.image,
                                                      calls=min(args.calls, 2000), say=say)
        if "router" not in args.skip:
            results["router"] = router_cost(root / "router", run_id, args.image, calls=min(args.calls, 2000), say=say)
        if "transfer" not in args.skip:
            results["transfer"] = transfer_cost(root / "transfer", mib=256 if args.quick else 1024, say=say)
        if "move" not in args.skip:
            results["move"] = move_cost(root / "move", run_id, args.image, mib=256 if args.quick else 1024, say=say)
        if "overhead" not in args.skip:
            say("sandboxd alone: the fake backend (no Docker)")
            results["overhead"] = run_variant(root / "fake", run_id, args, "backend: fake\n", "fake")
        if "instructions" not in args.skip:
            results["instructions"] = instructions.per_call(
                root / "instructions", run_id, args.image, calls=300 if args.quick else 1000, cpu_calls=args.calls,
                docker=True, say=say)
    finally:
        for container in api.containers(all=True, filters={"label": f"{f.LABEL}={run_id}"}):
            api.remove_container(container["Id"], force=True)
        shutil.rmtree(root, ignore_errors=True)
    results["seconds"] = round(time.monotonic() - started, 1)
    path = report.write_json(results, args.out)
    print(f"\nsandboxd benchmark — {report.machine_line(results['machine'])}; "
          f"{results['background_busy_pct']:.0f}% busy before the run\n")
    print(report.table(results))
    if results.get("daemon", {}).get("throughput") or results.get("floors", {}).get("throughput"):
        print("\nWhere the CPU went during the throughput windows:\n")
        print(report.cpu_table(results))
    print(f"\n{results['seconds']:.0f} s in all; JSON: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
