"""One user's tools as an MCP server, built on the SDK's low-level Server, relaying to the daemon.

``DaemonLink`` is the one connection to the daemon: it watches the user's tools
(tools/watch), learns which env names the daemon allows (sandbox/status), and connects
again after the daemon restarts: at once for the next request, and in the background so
that changes are heard again. ``build_server`` gives the handlers:

- tools/list: the daemon's listing for the user (which warms their sandboxes, as an agent
  session's listing should);
- tools/call: the call, in the user's sandbox; progress forwarded while the client asked
  for it (through a bounded backlog: a host that reads slowly loses progress updates, never
  memory or other calls' progress); the client's cancellation becomes the daemon's
  notifications/cancelled, which fires the tool's AbortSignal (grace and kill as the daemon
  does them);
- list_changed: to handshake-era connections on their standalone channel, from the moment
  they are initialized; to 2026-07-28 clients on their subscriptions/listen streams.
"""

from __future__ import annotations

import asyncio
import os
from pathlib import Path
from typing import Any, Callable, Mapping

import anyio
import mcp_types as types
from mcp.server.caching import CacheHint
from mcp.server.context import ServerRequestContext
from mcp.server.lowlevel import NotificationOptions, Server
from mcp.server.models import InitializationOptions
from mcp.server.subscriptions import ListenHandler, ServerEvent, ToolsListChanged
from mcp.shared.exceptions import MCPError

from sandboxd import __version__
from sandboxd.async_client import AsyncClient, ConnectionLost
from sandboxd.client import DaemonUnreachable, RpcError
from sandboxd.logging import get_logger
from sandboxd.mcp.convert import call_result, error_result, is_tool_error, mcp_tool, progress_message

log = get_logger("sandboxd.mcp")

PROGRESS_BACKLOG = 256  # progress updates of one call waiting for a slow host; past it they are dropped
RECONNECT_INTERVAL_S = 1.0


class ToolChanges:
    """Who hears that the user's tools changed: a SubscriptionBus for listen streams, and legacy connections."""

    def __init__(self) -> None:
        self._listeners: dict[object, Callable[[ServerEvent], None]] = {}

    def subscribe(self, listener: Callable[[ServerEvent], None]) -> Callable[[], None]:
        token = object()
        self._listeners[token] = listener

        def unsubscribe() -> None:
            self._listeners.pop(token, None)

        return unsubscribe

    async def publish(self, event: ServerEvent) -> None:
        self._tell(event)

    def changed(self) -> None:
        self._tell(ToolsListChanged())

    def _tell(self, event: ServerEvent) -> None:
        for listener in list(self._listeners.values()):
            listener(event)


class DaemonLink:
    def __init__(self, socket: Path, user: str, environ: Mapping[str, str] | None = None) -> None:
        self.socket, self.user = socket, user
        self.changes = ToolChanges()
        self.env: dict[str, str] = {}  # the integration variables passed with each call
        self._environ = os.environ if environ is None else environ
        self._client: AsyncClient | None = None
        self._lock = asyncio.Lock()

    async def client(self) -> AsyncClient:
        """The connection, made again if the daemon closed it. DaemonUnreachable if it cannot be."""
        async with self._lock:
            if self._client is None or self._client.closed.is_set():
                reconnecting = self._client is not None
                self._client = await self._open()
                if reconnecting:
                    log.info("daemon_reconnected", socket=str(self.socket))
                    self.changes.changed()  # the tools may have changed while it was away
            return self._client

    async def _open(self) -> AsyncClient:
        client = await AsyncClient.connect(self.socket, self._notified)
        try:
            # Watch before anything is listed: no change after this can go unheard.
            await client.call("tools/watch", {"user": self.user})
            status = await client.call("sandbox/status")
        except RpcError as exc:  # e.g. -32003: this process's uid is not in allowed_uids/allowed_gids
            await client.close()
            raise DaemonUnreachable(f"sandboxd on {self.socket} refused: {exc.message}") from None
        except BaseException:
            await client.close()
            raise
        allowed = status.get("limits", {}).get("allowedEnv") or []
        self.env = {name: self._environ[name] for name in allowed if name in self._environ}
        return client

    def _notified(self, method: str, params: dict[str, Any]) -> None:
        if method == "notifications/tools/list_changed":
            self.changes.changed()

    async def keep(self) -> None:
        """Connect again whenever the daemon goes away, so changes are heard again; until cancelled."""
        while True:
            try:
                client = await self.client()
            except DaemonUnreachable:
                await asyncio.sleep(RECONNECT_INTERVAL_S)
                continue
            await client.closed.wait()
            log.warning("daemon_connection_lost", socket=str(self.socket), hint="connecting again every second")
            await asyncio.sleep(RECONNECT_INTERVAL_S)

    async def close(self) -> None:
        if self._client is not None:
            await self._client.close()


class UserToolsServer(Server[Any]):
    """The SDK's low-level Server, whose handshake says that the tools list changes."""

    def create_initialization_options(self, notification_options: NotificationOptions | None = None,
                                      experimental_capabilities: dict[str, dict[str, Any]] | None = None,
                                      extensions: dict[str, dict[str, Any]] | None = None) -> InitializationOptions:
        return super().create_initialization_options(notification_options or NotificationOptions(tools_changed=True),
                                                     experimental_capabilities, extensions)


async def relay(ctx: ServerRequestContext[Any], client: AsyncClient, call: dict[str, Any],
                forward_progress: bool) -> dict[str, Any] | RpcError | ConnectionLost:
    """The daemon's answer to ``call``, or the error it ended in.

    With ``forward_progress``, each update goes to the client through a bounded backlog (a host that
    reads slowly loses updates, never memory), all of them before the answer. A cancel of the MCP
    request (or the client going away) becomes our notifications/cancelled: the tool's AbortSignal fires.
    """
    if not forward_progress:
        request_id, answer = await client.request("tools/call", call)
        try:
            return await answer
        except (RpcError, ConnectionLost) as exc:
            return exc
        except anyio.get_cancelled_exc_class():
            _cancel(client, request_id)
            raise
    backlog, updates = anyio.create_memory_object_stream[dict[str, Any]](PROGRESS_BACKLOG)

    def on_progress(update: dict[str, Any]) -> None:
        try:
            backlog.send_nowait(update)
        except (anyio.WouldBlock, anyio.ClosedResourceError):
            pass  # the host reads slower than the tool reports: this update is dropped

    async def forward() -> None:
        async with updates:
            async for update in updates:
                progress, message = progress_message(update)
                await ctx.session.report_progress(progress, None, message)

    request_id, answer = await client.request("tools/call", call, on_progress=on_progress)
    outcome: dict[str, Any] | RpcError | ConnectionLost
    try:
        async with anyio.create_task_group() as tasks:
            tasks.start_soon(forward)
            try:
                outcome = await answer
            except (RpcError, ConnectionLost) as exc:
                outcome = exc
            finally:
                backlog.close()  # forward() sends what is left, then the answer goes out
    except anyio.get_cancelled_exc_class():
        _cancel(client, request_id)
        raise
    return outcome


def _cancel(client: AsyncClient, request_id: int) -> None:
    client.cancel(request_id, "cancelled by the MCP client")
    client.forget(request_id)


def build_server(link: DaemonLink, *, timeout_ms: int | None = None) -> UserToolsServer:
    user = link.user

    async def list_tools(ctx: ServerRequestContext[Any], params: types.PaginatedRequestParams | None) -> types.ListToolsResult:
        try:
            client = await link.client()
            listing = await client.call("tools/list", {"user": user})
        except DaemonUnreachable as exc:
            raise MCPError(code=types.INTERNAL_ERROR, message=str(exc)) from None
        except RpcError as exc:
            raise MCPError(code=exc.code, message=exc.message) from None
        return types.ListToolsResult(tools=[mcp_tool(tool) for tool in listing["tools"]])

    async def call_tool(ctx: ServerRequestContext[Any], params: types.CallToolRequestParams) -> types.CallToolResult:
        try:
            client = await link.client()
        except DaemonUnreachable as exc:
            return error_result(str(exc), "unavailable")
        call: dict[str, Any] = {"user": user, "name": params.name, "arguments": params.arguments or {}}
        if link.env:
            call["env"] = link.env
        if timeout_ms is not None:
            call["timeoutMs"] = timeout_ms
        asked_for_progress = ctx.meta is not None and ctx.meta.get("progress_token") is not None
        try:
            outcome = await relay(ctx, client, call, asked_for_progress)
        except ConnectionLost as exc:
            outcome = exc
        if isinstance(outcome, ConnectionLost):
            return error_result(f"{outcome} Whether the tool ran to its end is unknown.", "unavailable")
        if isinstance(outcome, RpcError):
            if is_tool_error(outcome):
                return error_result(outcome.message, "refused")
            raise MCPError(code=outcome.code, message=outcome.message, data=outcome.data)
        return call_result(outcome)

    async def initialized(ctx: ServerRequestContext[Any], params: types.NotificationParams) -> None:
        # A handshake-era connection: tell it of changes on its standalone channel for as long
        # as it lives (this handler is cancelled with the connection).
        wake = asyncio.Event()
        unsubscribe = link.changes.subscribe(lambda _event: wake.set())
        try:
            while True:
                await wake.wait()
                wake.clear()
                await ctx.session.send_tool_list_changed()
        finally:
            unsubscribe()

    server = UserToolsServer(
        "sandboxd", version=__version__, title=f"sandboxd: {user}'s tools",
        instructions=f"The tools of {user}. Each call runs in {user}'s own sandbox, on that user's data.",
        # A user's tools change whenever they edit them; the list is theirs alone.
        cache_hints={"tools/list": CacheHint(ttl_ms=0, scope="private")},
        on_list_tools=list_tools, on_call_tool=call_tool, on_subscriptions_listen=ListenHandler(link.changes),
    )
    server.add_notification_handler("notifications/initialized", types.NotificationParams, initialized)
    # The SDK's OpenTelemetry middleware opens a span per message even with no exporter (docs/performance.md).
    # sandboxd traces nothing; its log says what ran.
    server.middleware = []
    return server
