"""Run the MCP server of one user until the host goes away (stdio) or a signal stops it (HTTP)."""

from __future__ import annotations

from dataclasses import dataclass, field

import anyio

from sandboxd.config import Config
from sandboxd.logging import get_logger
from sandboxd.mcp.bridge import DaemonLink, build_server
from sandboxd.mcp.limits import HttpLimits, connection_cap
from sandboxd.mcp.stdio import stdio_streams


@dataclass(frozen=True)
class HttpListen:
    host: str
    port: int
    token: bytes
    extra_origins: tuple[str, ...] = ()
    limits: HttpLimits = field(default_factory=HttpLimits)


async def serve(config: Config, user: str, *, timeout_ms: int | None = None, http: HttpListen | None = None) -> None:
    """DaemonUnreachable at once when the daemon does not answer: a host shows that, instead of a hang."""
    link = DaemonLink(config.socket, user)
    await link.client()
    server = build_server(link, timeout_ms=timeout_ms)
    try:
        async with anyio.create_task_group() as tasks:
            tasks.start_soon(link.keep)
            if http is None:
                async with stdio_streams(max_line=config.max_message_bytes) as (read, write):
                    await server.run(read, write, server.create_initialization_options())
            else:
                await _serve_http(server, http, config.max_message_bytes)
            tasks.cancel_scope.cancel()
    finally:
        await link.close()


async def _serve_http(server: object, listen: HttpListen, max_body: int) -> None:
    import uvicorn

    from sandboxd.mcp.connections import Admission, BoundedH11Protocol
    from sandboxd.mcp.http import app

    limits = listen.limits
    cap = connection_cap(limits.max_connections)
    asgi = app(server, host=listen.host, port=listen.port, token=listen.token, extra_origins=listen.extra_origins,
               max_body=max_body, limits=limits)
    protocol = BoundedH11Protocol.bound_by(Admission(cap, limits.head_timeout_s, listen.token))
    get_logger("sandboxd.mcp").info("mcp_http_listening", url=f"http://{listen.host}:{listen.port}/mcp",
                                    max_connections=cap, head_timeout_s=limits.head_timeout_s,
                                    max_sessions=limits.max_sessions, session_idle_s=limits.session_idle_s)
    await uvicorn.Server(uvicorn.Config(
        asgi, host=listen.host, port=listen.port, log_level="warning", access_log=False, lifespan="on",
        http=protocol, timeout_keep_alive=max(1, round(limits.head_timeout_s)),
        # The loop accepts what is queued in one go, before it reads any of it: a queue no longer than
        # the cap cannot push out a client accepted in the same go (older idle ones go first).
        backlog=cap,
    )).serve()
