"""Dialling another host's cluster listener: TLS with this side's certificate, and the server's role checked.

For the router's connections, a node pulling an export, and the operator's commands. The
server must show a certificate the cluster's CA signed whose common name is ``node:NAME``
(``node`` given: that very name). Then one ``ping`` proves this side got in: under TLS 1.3
the server reads the client's certificate after the client's handshake has ended, so a
refused certificate shows only at the first read. docs/security.md, "The cluster listener".
"""

from __future__ import annotations

import asyncio
import ssl

from sandboxd import strictjson
from sandboxd.async_client import AsyncClient, Notification
from sandboxd.client import DaemonUnreachable
from sandboxd.cluster.tls import Role, RoleRefused, client_context, role_of
from sandboxd.config.cluster import ClusterTLS
from sandboxd.wire import encode, request

DIAL_TIMEOUT_S = 10.0  # connect, handshake and the first ping
_PING_ID = "dial"

# What the server's alert says about this side's certificate.
_ALERTS = {
    "TLSV13_ALERT_CERTIFICATE_REQUIRED": "it needs a certificate",
    "TLSV1_ALERT_UNKNOWN_CA": "it does not trust the CA that signed this side's certificate",
    "SSLV3_ALERT_CERTIFICATE_EXPIRED": "this side's certificate has expired",
    "SSLV3_ALERT_BAD_CERTIFICATE": "it found this side's certificate bad",
    "SSLV3_ALERT_CERTIFICATE_UNKNOWN": "it could not use this side's certificate",
}


class DialFailed(DaemonUnreachable):
    """The host could not be reached, or was not who it should be; the message says which, and what to do."""


def split_address(address: str) -> tuple[str, int]:
    """``HOST:PORT`` (``[::1]:7443`` for IPv6) → (host, port); ValueError with an example."""
    host, sep, port = address.rpartition(":")
    if not sep or not host or not (port.isascii() and port.isdigit()) or not 0 < int(port) < 65536:
        raise ValueError(f"{address!r} is not HOST:PORT; e.g. '10.0.0.5:7443'")
    return host.removeprefix("[").removesuffix("]"), int(port)


async def dial(address: str, tls: ClusterTLS | ssl.SSLContext, *, node: str | None = None,
               timeout: float = DIAL_TIMEOUT_S) -> tuple[asyncio.StreamReader, asyncio.StreamWriter, Role]:
    """A connection to the host at ``address``, checked: its role, and a ping answered. DialFailed otherwise."""
    host, port = split_address(address)
    context = tls if isinstance(tls, ssl.SSLContext) else client_context(tls)
    try:
        reader, writer = await asyncio.wait_for(asyncio.open_connection(host, port, ssl=context), timeout)
    except asyncio.TimeoutError:
        raise DialFailed(f"{address} did not answer within {timeout:g} s; is the host up and its cluster.listen "
                         "reachable from here?") from None
    except ssl.SSLCertVerificationError as exc:
        raise DialFailed(f"{address}'s certificate is not one the cluster's CA (cluster.tls.ca) signed "
                         f"({exc.verify_message}); is it the right host, and this side's CA the cluster's?") from None
    except OSError as exc:
        raise DialFailed(f"cannot connect to {address} ({exc.strerror or exc}); is the daemon running there with "
                         "cluster.listen set, and the port open?") from None
    try:
        role = _server_role(address, writer, node)
        await asyncio.wait_for(_ping(address, reader, writer), timeout)
    except BaseException:
        writer.close()
        raise
    return reader, writer, role


async def connect_node(address: str, tls: ClusterTLS | ssl.SSLContext, *, node: str | None = None,
                       on_notification: Notification | None = None) -> AsyncClient:
    """The async client of the daemon at ``address``, over its cluster listener."""
    reader, writer, _ = await dial(address, tls, node=node)
    return AsyncClient(reader, writer, on_notification)


def _server_role(address: str, writer: asyncio.StreamWriter, node: str | None) -> Role:
    try:
        role = role_of(writer.get_extra_info("peercert"))
    except RoleRefused as exc:
        raise DialFailed(f"{address} shows a certificate of no role ({exc}); its cluster.tls.cert must be a "
                         "node:NAME certificate.") from None
    if role.kind != "node" or (node is not None and role.name != node):
        expected = f"node:{node}" if node is not None else "a node:NAME certificate"
        raise DialFailed(f"{address} is {role}, not {expected}: the address names another host; check the "
                         "directory's address for it (cluster.advertise).")
    return role


async def _ping(address: str, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    writer.write(encode(request(_PING_ID, "ping")))  # a few bytes: no drain, whose error would hide the alert's
    try:
        line = await reader.readline()
    except ssl.SSLError as exc:
        why = _ALERTS.get(exc.reason or "", f"TLS alert {exc.reason}")
        raise DialFailed(f"{address} refused this side's certificate: {why}. Use a certificate the cluster's CA "
                         "signed, still valid (cluster.tls.cert, docs/install.md, \"Certificates\").") from None
    except OSError:
        line = b""  # reset rather than closed: the same refusal
    if not line:
        raise DialFailed(f"{address} closed the connection before answering a ping: it refused this side's "
                         "certificate (the host's log says why, as tls_peer_refused).")
    answer = strictjson.loads_line(line)
    if "error" in answer:
        raise DialFailed(f"{address} refused this connection: {answer['error'].get('message')}")

