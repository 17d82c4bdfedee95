"""Clients of a running daemon: `sandboxd call` and `sandboxd status`."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
from pathlib import Path
from typing import Any, Mapping

from sandboxd.cli.common import (EXIT_FAILURE, EXIT_OK, EXIT_USAGE, add_argument_flags, fail, parse_tool_arguments,
                                 print_progress, print_result)
from sandboxd.cli.remote import add_node_address, check_node_address, open_daemon
from sandboxd.client import Client, DaemonUnreachable, RpcError
from sandboxd.config import Config


def add_commands(subparsers: argparse._SubParsersAction, parent: argparse.ArgumentParser) -> None:
    p = subparsers.add_parser(
        "call", parents=[parent], help="call a tool through a running daemon",
        description="Call a tool through the daemon's socket. Progress is printed to stderr as it comes, "
                    "then the result to stdout. Ctrl-C cancels the call. "
                    "Exit status: 0 ok, 1 the tool failed, 2 usage or daemon error.",
    )
    p.add_argument("name", help="tool name")
    p.add_argument("--user", required=True, help="whose tools, data and sandboxes (an email address)")
    add_argument_flags(p)
    p.add_argument("--env", action="append", default=[], metavar="NAME[=VALUE]",
                   help="a variable the tool sees during this call (repeatable), e.g. --env PI_SEARXNG_URL=http://10.0.0.7:8080; "
                        "NAME alone passes this shell's $NAME, which keeps a secret off the command line (where "
                        "other local users can read it). Only names the daemon allows (calls.allowed_env)")
    p.add_argument("--timeout", type=float, metavar="S", help="deadline in seconds (capped by the daemon)")
    p.add_argument("--socket", type=Path, metavar="PATH", help="the daemon's socket")
    p.add_argument("--raw", action="store_true", help="print the raw result object as JSON")
    p.set_defaults(handler=run_call)

    s = subparsers.add_parser("status", parents=[parent], help="show a running daemon's status",
                              description="Print sandbox/status of a running daemon.")
    s.add_argument("--socket", type=Path, metavar="PATH", help="the daemon's socket")
    add_node_address(s)
    s.add_argument("--json", action="store_true", help="print the raw status object")
    s.set_defaults(handler=run_status)


_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def parse_env(items: list[str], environ: Mapping[str, str] = os.environ) -> dict[str, str]:
    """--env NAME=VALUE / --env NAME (from ``environ``). Raises ValueError with a usage message.

    Which names may be set is the daemon's to say (calls.allowed_env); its refusal names them."""
    env: dict[str, str] = {}
    for item in items:
        name, sep, value = item.partition("=")
        if not _ENV_NAME.fullmatch(name):
            raise ValueError(f"--env {item!r} must look like NAME=VALUE or NAME, with NAME a variable name "
                             "such as PI_SEARXNG_URL")
        if name in env:
            raise ValueError(f"--env {name} is given twice; give each name once")
        if not sep:
            if name not in environ:
                raise ValueError(f"--env {name}: ${name} is not set in this shell; export it or give --env {name}=VALUE")
            value = environ[name]
        env[name] = value
    return env


def run_call(args: argparse.Namespace, config: Config) -> int:
    try:
        arguments = parse_tool_arguments(args)
        env = parse_env(args.env)
    except ValueError as exc:
        return fail(str(exc), EXIT_USAGE)
    params: dict[str, Any] = {"user": args.user, "name": args.name, "arguments": arguments}
    if env:
        params["env"] = env
    if args.timeout is not None:
        params["timeoutMs"] = int(args.timeout * 1000)
    try:
        with Client(config.socket) as client:
            result = client.request(
                "tools/call", params, on_progress=print_progress,
                on_interrupt=lambda rid: client.cancel(rid, "cancelled with Ctrl-C"),
            )
    except (DaemonUnreachable, RpcError) as exc:
        return fail(str(exc), EXIT_USAGE)
    except KeyboardInterrupt:
        return 130
    if args.raw:
        print(json.dumps(result, indent=2))
    else:
        print_result(result)
    return EXIT_OK if result.get("status") == "ok" else EXIT_FAILURE


def run_status(args: argparse.Namespace, config: Config) -> int:
    usage = check_node_address(args, config)
    if usage is not None:
        return fail(usage, EXIT_USAGE)
    try:
        if args.node_address is not None:
            status = asyncio.run(_remote_status(args, config))
        else:
            with Client(config.socket) as client:
                status = client.request("sandbox/status")
    except (DaemonUnreachable, RpcError) as exc:
        return fail(str(exc), EXIT_USAGE)
    if args.json:
        print(json.dumps(status, indent=2))
        return EXIT_OK
    print(format_status(status))
    return EXIT_OK


async def _remote_status(args: argparse.Namespace, config: Config) -> Any:
    client = await open_daemon(args, config)
    try:
        return await client.call("sandbox/status")
    finally:
        await client.close()


def count(n: int, noun: str, many: str | None = None) -> str:
    """ "1 connection", "2 connections": a count with its noun in the right number."""
    return f"{n} {noun if n == 1 else many or noun + 's'}"


def format_status(status: dict[str, Any]) -> str:
    """sandbox/status for a person: one line per topic, a line per user with sandboxes."""
    pool, limits = status["pool"], status.get("limits", {})
    totals, counters = pool["totals"], pool.get("counters", {})
    lines = [
        f"sandboxd {status['version']} — backend {status['backend']}"
        + (f" over {status['transport']}" if status.get("transport") else "")
        + (" (UNSANDBOXED)" if status.get("unsandboxed") else "")
        + (" — STOPPING" if status.get("stopping") else "")
        + f", up {status['uptimeS']} s, {count(status['connections'], 'connection')}, "
        f"{count(status['callsInFlight'], 'call')} in flight",
        f"sandboxes: {totals['idle']} idle, {totals['busy']} busy, {totals['starting']} starting, "
        f"{totals.get('stopping', 0)} stopping; {count(totals['waiting'], 'call')} queued",
    ]
    for user, row in sorted(pool["users"].items()):
        lines.append(f"  {user}: {row['idle']} idle, {row['busy']} busy, {row['starting']} starting, "
                     f"{row.get('stopping', 0)} stopping, {row['waiting']} queued")
    sharing, refusals = pool.get("sharing"), pool.get("refusals") or {}
    if sharing:
        lines.append(f"sharing: {count(sharing['activeUsers'], 'user')} active, a fair share of "
                     f"{count(sharing['fairShare'], 'sandbox', 'sandboxes')} each, the last {sharing['reserve']} kept "
                     "for first calls; refused for want of a "
                     f"sandbox: {refusals.get('user_limit', 0)} at the user's limit, {refusals.get('reserve', 0)} "
                     f"by the reserve, {refusals.get('pool_full', 0)} with the pool full")
    if counters:
        lines.append(f"lifecycle: {counters.get('started', 0)} started, {counters.get('destroyed', 0)} destroyed, "
                     f"{counters.get('killed', 0)} killed, {counters.get('crashed', 0)} crashed, "
                     f"{counters.get('start_failures', 0)} failed to start")
    calls = status.get("calls") or {}
    lines.append("calls: " + (", ".join(f"{k} {v}" for k, v in sorted(calls.items())) if calls else "none yet"))
    storage = status.get("storage")
    if storage:
        from sandboxd.storage.quota import size_text

        modes = ", ".join(f"{place['area']} folders {place['mode']}" for place in storage["enforcement"])
        lines.append(f"disk quota: {modes}; {count(storage['refusals'], 'call')} refused over quota")
        for user, row in sorted(storage["users"].items()):
            lines.append(f"  {user}: {size_text(row['bytes'])} of {size_text(row['limitBytes'])}, "
                         f"{row['inodes']} of {row['limitInodes']} files" + (" — OVER QUOTA" if row["over"] else ""))
    if limits:
        per_user = count(limits["maxPerUser"], "sandbox", "sandboxes")
        lines.append(f"limits: {per_user} per user, {limits['maxTotal']} in all, "
                     f"{limits['minIdle']} kept warm for {limits['idleTtlS']:g} s; "
                     f"call timeout {limits['defaultTimeoutMs']} ms (at most {limits['maxTimeoutMs']} ms)")
    return "\n".join(lines + _fleet_lines(status))


def _fleet_lines(status: dict[str, Any]) -> list[str]:
    """A router's status: a line per host that answered, and the hosts that did not (docs/protocol.md)."""
    if not status.get("router"):
        return []
    hosts = status.get("hosts") or {}
    lines = [f"router in front of {count(len(hosts) + len(status.get('unanswered') or []), 'host')}:"]
    for node, host in sorted(hosts.items()):
        totals = (host.get("pool") or {}).get("totals") or {}
        lines.append(f"  host {node} ({host.get('state') or 'unregistered'}): {totals.get('idle', 0)} idle, "
                     f"{totals.get('busy', 0)} busy, {count(host.get('callsInFlight', 0), 'call')} in flight, "
                     f"up {host.get('uptimeS', '?')} s")
    for node in status.get("unanswered") or []:
        lines.append(f"  host {node}: DID NOT ANSWER (check that it runs and its listener is reachable)")
    return lines
