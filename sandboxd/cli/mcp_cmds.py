"""`sandboxd mcp`: one user's tools for an MCP host (docs/mcp.md)."""

from __future__ import annotations

import argparse
import asyncio
import os
from pathlib import Path

from sandboxd.cli.common import EXIT_OK, EXIT_USAGE, fail
from sandboxd.client import DaemonUnreachable
from sandboxd.config import Config
from sandboxd.errors import InvalidParams
from sandboxd.mcp.limits import HttpLimits, connection_cap
from sandboxd.users import check_user


def add_commands(subparsers: argparse._SubParsersAction, parent: argparse.ArgumentParser) -> None:
    p = subparsers.add_parser(
        "mcp", parents=[parent], help="serve one user's tools to an MCP host (stdio, or --http)",
        description="An MCP server of one user's tools, each call run in that user's sandbox by the running daemon "
                    "(it is a client of the daemon's socket; nothing new listens unless --http says so). Speaks MCP "
                    "on stdin/stdout for a host that starts it; with --http, streamable HTTP at /mcp, every request "
                    "needing 'Authorization: Bearer $SANDBOXD_MCP_TOKEN'. The env names the daemon allows "
                    "(calls.allowed_env) are passed from this process's environment with each call. "
                    "Exit status: 0 when the host goes away, 2 usage or daemon error. See docs/mcp.md.",
    )
    p.add_argument("--user", required=True, help="whose tools, data and sandboxes (an email address)")
    p.add_argument("--socket", type=Path, metavar="PATH", help="the daemon's socket")
    p.add_argument("--http", metavar="HOST:PORT",
                   help="serve streamable HTTP at http://HOST:PORT/mcp instead of stdio (loopback only unless "
                        "allow_unsafe names mcp_http_remote)")
    p.add_argument("--allow-origin", action="append", default=[], metavar="ORIGIN",
                   help="with --http: an Origin (and its Host) to serve besides loopback's, e.g. a TLS proxy's "
                        "https://mcp.example.com (repeatable)")
    limits = p.add_argument_group("with --http: bounds, before and after the token (docs/mcp.md)")
    limits.add_argument("--head-timeout", type=float, default=HttpLimits.head_timeout_s, metavar="S",
                        help="close a connection that has not sent a whole request head S seconds after it opened or "
                             "was last answered (default %(default)s)")
    limits.add_argument("--max-connections", type=int, default=HttpLimits.max_connections, metavar="N",
                        help="open connections at most (fewer if the open-file limit is lower); past it the oldest "
                             "one not mid-request is closed (default %(default)s)")
    limits.add_argument("--max-sessions", type=int, default=HttpLimits.max_sessions, metavar="N",
                        help="MCP sessions at most; another is answered 503 (default %(default)s)")
    limits.add_argument("--session-idle-timeout", type=float, default=HttpLimits.session_idle_s, metavar="S",
                        help="end a session with no request for S seconds (default %(default)s)")
    p.add_argument("--timeout", type=float, metavar="S",
                   help="each call's deadline in seconds, passed as timeoutMs (default: the daemon's, "
                        "calls.default_timeout_ms; capped by calls.max_timeout_ms)")
    p.set_defaults(handler=run_mcp)


def run_mcp(args: argparse.Namespace, config: Config) -> int:
    from sandboxd.logging import configure_logging
    from sandboxd.mcp.serve import HttpListen, serve

    try:
        user = check_user(args.user)
    except InvalidParams as exc:
        return fail(f"--user: {exc.message}", EXIT_USAGE)
    if args.timeout is not None and args.timeout <= 0:
        return fail("--timeout must be a positive number of seconds", EXIT_USAGE)
    http = None
    if args.http is not None:
        from sandboxd.mcp.http import parse_address, token_from

        host, port = parse_address(args.http, config.allow_unsafe)  # ConfigError: main says it, exit 2
        limits = HttpLimits(args.head_timeout, args.max_connections, args.max_sessions, args.session_idle_timeout)
        connection_cap(limits.max_connections)  # an open-file limit too low for any: said now, before the daemon is asked
        http = HttpListen(host, port, token_from(os.environ), tuple(args.allow_origin), limits)
    elif args.allow_origin:
        return fail("--allow-origin needs --http", EXIT_USAGE)
    configure_logging(config.log_level, config.log_format)  # stderr: stdout is the protocol's
    timeout_ms = None if args.timeout is None else max(1, int(args.timeout * 1000))
    from sandboxd.cli.serve_cmds import event_loop_factory

    try:
        with asyncio.Runner(loop_factory=event_loop_factory(config.event_loop)) as runner:
            runner.run(serve(config, user, timeout_ms=timeout_ms, http=http))
    except DaemonUnreachable as exc:
        return fail(f"cannot serve {user}'s tools: {exc}", EXIT_USAGE)
    return EXIT_OK
