"""The egress proxy: the one way out of a sandbox, which has no network of its own.

Each sandbox gets a unix socket of its own (the backend binds it in the sandbox's
socket directory and hands every connection to that sandbox's ``EgressSession``),
so the proxy knows whose traffic it carries without trusting anything the sandbox
says. One request per connection, in HTTP/1.1 proxy form:

- ``CONNECT host:port`` (HTTPS, and everything the shim tunnels) → 200, then bytes;
- an absolute-form request ``GET http://host[:port]/path`` (what curl and Python's
  urllib send for http:// through ``http_proxy``) → forwarded with ``Connection: close``.

The name is resolved here, every address checked (egress/policy.py), and the
connection made to a checked address only. A refusal answers 403 with
``X-Sandboxd-Egress: refused`` and one line saying why and who can change it; a
failure (no such name, refused, timed out) 502/504 with ``X-Sandboxd-Egress: failed``.
docs/security.md ("The network boundary") says what this stops and what it does not.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import ipaddress
import os
import socket
import time
from typing import Awaitable, Callable
from urllib.parse import urlsplit

from sandboxd.config import EgressConfig
from sandboxd.egress.addresses import SCOPED
from sandboxd.egress.policy import EgressPolicy, IPAddress, Verdict, host_addresses, is_host_name, parse_address
from sandboxd.logging import get_logger, masking
from sandboxd.sandbox.backend import EgressContext

log = get_logger("sandboxd.egress")

MAX_HEAD_BYTES = 16 << 10
HEAD_TIMEOUT_S = 10.0
# Small buffers: a sandbox may hold egress.max_connections of these, each buffering both ways.
STREAM_LIMIT = 16 << 10
WRITE_HIGH_WATER = 32 << 10
CHUNK = 16 << 10
HOST_ADDRESSES_TTL_S = 60.0
# Lookups can block for the resolver's whole timeout: a pool of their own, and at most
# LOOKUPS_PER_SANDBOX of them per sandbox, so one sandbox's slow names cannot hold them all.
DNS_THREADS = 8
LOOKUPS_PER_SANDBOX = 2
# Dropped from a forwarded request: they speak to the proxy, or ask for a connection we do not keep.
_HOP_HEADERS = frozenset({b"proxy-connection", b"proxy-authorization", b"connection", b"keep-alive"})

Resolve = Callable[[str, int], Awaitable[list[IPAddress]]]  # name, port → addresses; OSError if none


class _Refused(Exception):
    """The request failed (not by policy): answer ``status`` and ``message``; ``reason`` is logged and counted."""

    def __init__(self, status: int, message: str, reason: str) -> None:
        super().__init__(message)
        self.status, self.message, self.reason = status, message, reason


_REASONS = {400: "Bad Request", 403: "Forbidden", 502: "Bad Gateway", 503: "Service Unavailable",
            504: "Gateway Timeout"}


def _answer(status: int, kind: str, message: str) -> bytes:
    body = (message.replace("\r", " ").replace("\n", " ") + "\n").encode()
    return (f"HTTP/1.1 {status} {_REASONS[status]}\r\nX-Sandboxd-Egress: {kind}\r\n"
            f"Content-Type: text/plain; charset=utf-8\r\nContent-Length: {len(body)}\r\n"
            "Connection: close\r\n\r\n").encode() + body


class EgressProxy:
    """The policy, the resolver and the counters every sandbox's session shares."""

    def __init__(self, config: EgressConfig, *, resolve: Resolve | None = None) -> None:
        # Not the default executor: a tool asking for slow names must not hold the threads other work runs on.
        self._dns = concurrent.futures.ThreadPoolExecutor(max_workers=DNS_THREADS, thread_name_prefix="sandboxd-dns")
        self._resolve = resolve or self._getaddrinfo
        self._host_addresses: frozenset[IPAddress] = frozenset()
        self._host_addresses_at = float("-inf")
        self.decisions: collections.Counter[tuple[str, str]] = collections.Counter()  # (decision, reason) → count
        self.config = config
        self.policy = self._policy(config)

    def _policy(self, config: EgressConfig) -> EgressPolicy:
        return EgressPolicy(config.policy, config.allow, config.ports, self._own_addresses())

    def _own_addresses(self) -> frozenset[IPAddress]:
        now = time.monotonic()
        if now - self._host_addresses_at > HOST_ADDRESSES_TTL_S:
            self._host_addresses, self._host_addresses_at = host_addresses(), now
        return self._host_addresses

    def reconfigure(self, config: EgressConfig) -> None:
        """A new policy for requests from now on (tunnels already open stay)."""
        self.config, self.policy = config, self._policy(config)

    def session(self, user: str, sandbox_id: str, context: EgressContext) -> EgressSession:
        return EgressSession(self, user, sandbox_id, context)

    def close(self) -> None:
        self._dns.shutdown(wait=False, cancel_futures=True)

    async def _getaddrinfo(self, host: str, port: int) -> list[IPAddress]:
        loop = asyncio.get_running_loop()
        infos = await loop.run_in_executor(self._dns, socket.getaddrinfo, host, port, 0, socket.SOCK_STREAM)
        addresses: list[IPAddress] = []
        for _family, _type, _proto, _name, sockaddr in infos:
            address = ipaddress.ip_address(str(sockaddr[0]).split("%")[0])
            if address not in addresses:
                addresses.append(address)
        return addresses

    async def decide(self, host: str, port: int, lookups: asyncio.Semaphore) -> tuple[list[IPAddress], Verdict]:
        """The addresses a connection may go to (in order), and the verdict; ``[]`` when refused.

        ``lookups`` bounds the sandbox's lookups in flight, counted until each one's thread is
        done (a timed-out lookup still holds a thread). Raises _Refused for a name that does
        not resolve (in time)."""
        policy = self.policy
        if policy.host_addresses is not self._own_addresses():
            policy = self.policy = self._policy(self.config)
        literal = parse_address(host)
        early = policy.before_resolving(host, port, literal)
        if early is not None:
            return [], early
        if literal is not None:
            addresses = [literal]
        else:
            try:
                async with asyncio.timeout(self.config.connect_timeout_ms / 1000):
                    await lookups.acquire()
                    lookup = asyncio.ensure_future(self._resolve(host, port))
                    lookup.add_done_callback(lambda done: (lookups.release(), done.cancelled() or done.exception()))
                    addresses = await asyncio.shield(lookup)
            except TimeoutError:
                raise _Refused(504, f"egress to {host}:{port} failed: resolving the name took longer than "
                                    f"{self.config.connect_timeout_ms} ms (egress.connect_timeout_ms)",
                               reason="resolve timeout") from None
            except (OSError, UnicodeError) as exc:
                raise _Refused(502, f"egress to {host}:{port} failed: the name does not resolve ({exc})",
                               reason="name does not resolve") from None
            if not addresses:
                raise _Refused(502, f"egress to {host}:{port} failed: the name has no address",
                               reason="name does not resolve")
        verdicts = [(address, policy.for_address(host, port, address)) for address in addresses]
        allowed = [address for address, verdict in verdicts if verdict.allowed]
        if allowed:
            return allowed, next(verdict for _, verdict in verdicts if verdict.allowed)
        return [], verdicts[0][1] if len(verdicts) == 1 else _first_refusal(verdicts)


def _first_refusal(verdicts: list[tuple[IPAddress, Verdict]]) -> Verdict:
    address, verdict = verdicts[0]
    return Verdict(False, f"{verdict.reason} ({address}, and every other address of the name)")


def refusal_message(host: str, port: int, address: IPAddress | None, verdict: Verdict) -> str:
    where = f"{host}:{port}" if address is None or str(address) == host else f"{host}:{port} ({address})"
    if verdict.reason.startswith("egress.policy is none"):
        hint = "the operator can change egress.policy"
    elif verdict.reason.startswith("port "):
        hint = "the operator can add the port to egress.ports, or name host:port in egress.allow"
    elif verdict.reason.startswith("not in egress.allow"):
        hint = "the operator can add it to egress.allow"
    elif verdict.reason == SCOPED:
        hint = "send the address without its %zone, or the operator can allow it with egress.allow"
    else:
        hint = "the operator can allow it with egress.allow"
    return f"egress to {where} refused by sandboxd's egress policy: {verdict.reason}; {hint}"


class EgressSession:
    """One sandbox's egress: its connections (bounded), each one request."""

    def __init__(self, proxy: EgressProxy, user: str, sandbox_id: str, context: EgressContext) -> None:
        self._proxy = proxy
        self.user = user
        self.sandbox_id = sandbox_id
        self._context = context
        self._connections: set[asyncio.Task[None]] = set()
        self._bucket = _Bucket(proxy.config.rate_bytes)
        self._lookups = asyncio.Semaphore(LOOKUPS_PER_SANDBOX)

    def __repr__(self) -> str:
        return f"<EgressSession {self.user} {self.sandbox_id} connections={len(self._connections)}>"

    @property
    def connections(self) -> int:
        return len(self._connections)

    async def handle(self, conn: socket.socket) -> None:
        """Serve one connection from the sandbox; never raises."""
        task = asyncio.current_task()
        assert task is not None
        try:
            reader, writer = await asyncio.open_connection(sock=conn, limit=STREAM_LIMIT)
        except OSError:
            conn.close()
            return
        writer.transport.set_write_buffer_limits(high=WRITE_HIGH_WATER)
        self._connections.add(task)
        try:
            limit = self._proxy.config.max_connections
            if len(self._connections) > 2 * limit:
                return  # a flood: no answer, the connection just closes
            if len(self._connections) > limit:
                self._record("refused", "too many connections", None, 0, None)
                await self._reply(writer, 503, "failed", f"egress refused: this sandbox already holds {limit} "
                                                         "egress connections (egress.max_connections); close some "
                                                         "first", reader)
            else:
                await self._serve(reader, writer)
        except (ConnectionError, asyncio.IncompleteReadError, OSError):
            pass
        except asyncio.CancelledError:
            pass  # the sandbox is going away (close)
        finally:
            self._connections.discard(task)
            writer.transport.abort()

    def close(self) -> None:
        """The sandbox is destroyed: end its connections now."""
        for task in list(self._connections):
            task.cancel()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        config = self._proxy.config
        try:
            async with asyncio.timeout(HEAD_TIMEOUT_S):
                head = await reader.readuntil(b"\r\n\r\n")
        except asyncio.IncompleteReadError as exc:
            if exc.partial:
                await self._reply(writer, 400, "failed", "egress request malformed: the connection ended inside "
                                                         "the request head")
            return
        except (asyncio.LimitOverrunError, TimeoutError) as exc:
            problem = (f"the request head exceeds {MAX_HEAD_BYTES} bytes" if isinstance(exc, asyncio.LimitOverrunError)
                       else f"no complete request head within {HEAD_TIMEOUT_S:g} s")
            await self._reply(writer, 400, "failed", f"egress request malformed: {problem}", reader)
            return
        if len(head) > MAX_HEAD_BYTES:
            await self._reply(writer, 400, "failed", f"egress request malformed: the request head exceeds "
                                                     f"{MAX_HEAD_BYTES} bytes", reader)
            return
        try:
            method, host, port, forward = _parse(head)
        except ValueError as exc:
            await self._reply(writer, 400, "failed", f"egress request malformed: {exc}", reader)
            return
        try:
            addresses, verdict = await self._proxy.decide(host, port, self._lookups)
        except _Refused as refused:
            self._record("failed", refused.reason, host, port, None)
            await self._reply(writer, refused.status, "failed", refused.message, reader)
            return
        if not addresses:
            self._record("refused", verdict.reason, host, port, parse_address(host))
            await self._reply(writer, 403, "refused", refusal_message(host, port, None, verdict), reader)
            return
        try:
            upstream_reader, upstream_writer, address = await self._connect(addresses, port, config.connect_timeout_ms)
        except _Refused as refused:
            self._record("failed", refused.reason, host, port, addresses[0])
            await self._reply(writer, refused.status, "failed", f"egress to {host}:{port} failed: {refused.message}",
                              reader)
            return
        self._record("allowed", verdict.reason, host, port, address)
        try:
            upstream_writer.transport.set_write_buffer_limits(high=WRITE_HIGH_WATER)
            if method == "CONNECT":
                writer.write(b"HTTP/1.1 200 Connection established\r\n\r\n")
            else:
                upstream_writer.write(forward)
            self._bucket.rate = config.rate_bytes  # a reload's new rate applies from here
            await _relay(reader, writer, upstream_reader, upstream_writer, config.idle_timeout_s, self._bucket)
        finally:
            upstream_writer.transport.abort()

    async def _connect(self, addresses: list[IPAddress], port: int,
                       timeout_ms: int) -> tuple[asyncio.StreamReader, asyncio.StreamWriter, IPAddress]:
        last: str = "no address"
        try:
            async with asyncio.timeout(timeout_ms / 1000):
                for address in addresses:  # only addresses the policy allowed: never a new lookup
                    try:
                        r, w = await asyncio.open_connection(str(address), port, limit=STREAM_LIMIT)
                        return r, w, address
                    except OSError as exc:
                        last = os.strerror(exc.errno) if exc.errno else str(exc)
        except TimeoutError:
            raise _Refused(504, f"connecting took longer than {timeout_ms} ms (egress.connect_timeout_ms)",
                           reason="connect timeout") from None
        raise _Refused(502, last.lower() if last else "connection failed", reason="connect failed")

    async def _reply(self, writer: asyncio.StreamWriter, status: int, kind: str, message: str,
                     reader: asyncio.StreamReader | None = None) -> None:
        """Answer and end the request: the answer, then EOF, then what the client still sends is read and dropped."""
        writer.write(_answer(status, kind, message))
        try:
            async with asyncio.timeout(HEAD_TIMEOUT_S):
                await writer.drain()
            if writer.can_write_eof():
                writer.write_eof()
        except (TimeoutError, ConnectionError, OSError):
            return
        if reader is not None:
            await _discard_request(reader)

    def _record(self, decision: str, reason: str, host: str | None, port: int, address: IPAddress | None) -> None:
        tool, secrets = self._context()
        self._proxy.decisions[(decision, _reason_label(reason))] += 1
        with masking(secrets):  # a tool could put its token in a host name
            log.info("egress", user=self.user, sandbox=self.sandbox_id, tool=tool, host=host, port=port,
                     address=str(address) if address is not None else None, decision=decision, reason=reason)


async def _discard_request(reader: asyncio.StreamReader) -> None:
    """Read what the client sent, briefly: closing over unread bytes would reset the
    connection, and the client would see a reset instead of the answer."""
    try:
        async with asyncio.timeout(1.0):
            await reader.read(MAX_HEAD_BYTES)
    except (TimeoutError, ConnectionError):
        pass


def _reason_label(reason: str) -> str:
    """A bounded label for the metrics: the reason's class, without hosts, entries, ranges or
    the IPv6 form an IPv4 address came in (egress/addresses.py: "words (source), inside ...")."""
    if reason.startswith("egress.allow entry"):
        return "egress.allow"
    if reason.startswith("port "):
        return "port not allowed"
    return reason.split(" (")[0].split(", ")[0].split(":")[0]


def _parse(head: bytes) -> tuple[str, str, int, bytes]:
    """(method, host, port, the request to forward or b"") from a request head; ValueError says what is wrong."""
    lines = head[:-4].split(b"\r\n")
    parts = lines[0].split(b" ")
    if len(parts) != 3 or not parts[2].startswith(b"HTTP/1."):
        raise ValueError(f"{lines[0][:200]!r} is not an HTTP/1.x request line")
    method, target = parts[0].decode("ascii", "replace"), parts[1].decode("ascii", "replace")
    if not method.isalpha() or not method.isupper():
        raise ValueError(f"{method[:40]!r} is not an HTTP method")
    for line in lines[1:]:
        if b":" not in line or line[:1] in (b" ", b"\t"):
            raise ValueError(f"header line {line[:200]!r} is malformed (or folded)")
    if method == "CONNECT":
        host, port = _authority(target)
        return method, host, port, b""
    url = urlsplit(target)
    if url.scheme == "https":
        raise ValueError(f"{target[:200]!r}: https goes through CONNECT host:443, not an absolute https:// request")
    if url.scheme != "http" or not url.netloc:
        raise ValueError(f"{target[:200]!r} is neither CONNECT host:port nor an absolute http:// URL")
    host, port = _authority(url.netloc if ":" in url.netloc.rsplit("]", 1)[-1] else f"{url.netloc}:80")
    path = url.path or "/"
    if url.query:
        path += "?" + url.query
    headers = [line for line in lines[1:] if line.split(b":", 1)[0].strip().lower() not in _HOP_HEADERS]
    if not any(line.split(b":", 1)[0].strip().lower() == b"host" for line in headers):
        headers.insert(0, b"Host: " + url.netloc.encode())
    forward = b"\r\n".join([f"{method} {path} HTTP/1.1".encode(), *headers, b"Connection: close", b"", b""])
    return method, host, port, forward


def _authority(text: str) -> tuple[str, int]:
    if "@" in text:
        raise ValueError(f"{text[:200]!r}: credentials in the address are not accepted")
    host, sep, port_text = text.rpartition(":")
    if not sep or not host:
        raise ValueError(f"{text[:200]!r} is not host:port")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
        if parse_address(host) is None:
            raise ValueError(f"{text[:200]!r}: [{host}] is not an IPv6 address")
    if not port_text.isdigit() or not 0 < int(port_text) < 65536:
        raise ValueError(f"{text[:200]!r}: {port_text[:20]!r} is not a port (1-65535)")
    host = host.lower().rstrip(".")
    if parse_address(host) is None and not is_host_name(host):
        raise ValueError(f"{host[:200]!r} is not a host name or an IP address")
    return host, int(port_text)


class _Bucket:
    """A token bucket of bytes per second, shared by a sandbox's connections: a sandbox moving
    data as fast as it can costs the daemon's loop a bounded share of a core."""

    def __init__(self, rate: float) -> None:
        self.rate = rate
        self._tokens = rate  # one second's worth at once
        self._at = time.monotonic()

    async def spend(self, size: int) -> None:
        now = time.monotonic()
        self._tokens = min(self.rate, self._tokens + (now - self._at) * self.rate) - size
        self._at = now
        if self._tokens < 0:
            await asyncio.sleep(-self._tokens / self.rate)


async def _relay(reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                 upstream_reader: asyncio.StreamReader, upstream_writer: asyncio.StreamWriter,
                 idle_timeout_s: float, bucket: _Bucket) -> None:
    """Copy both ways until the upstream is done, or both sides are, or nothing moves for ``idle_timeout_s``."""
    last = [time.monotonic()]

    async def pump(src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
        while True:
            data = await src.read(CHUNK)
            if not data:
                if dst.can_write_eof() and not dst.is_closing():
                    dst.write_eof()
                return
            await bucket.spend(len(data))
            dst.write(data)
            await dst.drain()  # backpressure: a slow reader slows the writer, nothing piles up here
            last[0] = time.monotonic()

    up = asyncio.ensure_future(pump(reader, upstream_writer))
    down = asyncio.ensure_future(pump(upstream_reader, writer))
    try:
        pending = {up, down}
        while pending:
            done, pending = await asyncio.wait(pending, timeout=min(idle_timeout_s, 5.0),
                                               return_when=asyncio.FIRST_COMPLETED)
            if down in done or any(task.exception() is not None for task in done if not task.cancelled()):
                break  # the response ended (or a side broke): nothing more to carry
            if not done and time.monotonic() - last[0] > idle_timeout_s:
                break
        if down.done() and not down.cancelled() and down.exception() is None:
            await writer.drain()
    finally:
        for task in (up, down):
            task.cancel()
        await asyncio.gather(up, down, return_exceptions=True)
