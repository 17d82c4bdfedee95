"""The egress proxy: the one way out of a sandbox, which has no network of its own.

Each sandbox gets a unix socket of its own (the backend binds it in the sandbox's
socket directory and hands every connection to that sandbox's ``EgressSession``),
so the proxy knows whose traffic it carries without trusting anything the sandbox
says. One request per connection, in HTTP/1.1 proxy form, read by a strict parser
(egress/http1.py: llhttp), which refuses with 400 anything it could not forward exactly
as it understood it (bare CR or LF, control characters, obs-fold, ambiguous framing):

- ``CONNECT host:port`` (HTTPS, and everything the shim tunnels) → 200, then bytes;
- an absolute-form request ``GET http://host[:port]/path`` (what curl and Python's
  urllib send for http:// through ``http_proxy``) → forwarded as the proxy writes it again
  from what it parsed (``Connection: close``), with exactly the body its framing says; the
  sandbox's bytes after the request's end are never sent on (400 when they came with the
  head; dropped when they come later), and only the answer comes back;
- ``GET https://host[:port]/path`` in absolute form, plaintext on the socket, for the
  hosts of ``egress.secrets`` only (the shim sends their requests so): the proxy makes the
  TLS connection itself, verifying the certificate against the host's trust store (and
  ``egress.ca_file``), so that it can put the secrets' values in (egress/secrets.py).

The name is resolved here, every address checked (egress/policy.py), and the
connection made to a checked address only. A connection admitted by what only the running
call was granted (the browser relay's port, a secret's value put in) ends when the call is
answered (egress/grants.py). A refusal answers 403 with
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
import ssl
import time
from typing import Awaitable, Callable
from urllib.parse import urlsplit

from sandboxd.config import EgressConfig
from sandboxd.egress.addresses import SCOPED
from sandboxd.egress.browser_relay import RELAY_NAME, BrowserRelay, relay_refusal_message, tunnel_verdict
from sandboxd.egress.grants import GRANT_ENDED
from sandboxd.egress.http1 import MAX_HEAD_BYTES, Head, Malformed, RequestReader
from sandboxd.egress.policy import EgressPolicy, IPAddress, Verdict, host_addresses, is_host_name, parse_address
from sandboxd.egress.relay import Relay
from sandboxd.egress.secrets import Rewrite, StandIns, names_host, parse_secret_hosts
from sandboxd.logging import get_logger, masking, source
from sandboxd.sandbox.backend import EgressContext
from sandboxd.service.fds import EGRESS_REFUSING
from sandboxd.service.peercred import PeerCredentials, peer_credentials

log = get_logger("sandboxd.egress")

HEAD_TIMEOUT_S = 10.0
HOST_ADDRESSES_TTL_S = 60.0
# A sandbox counts as moving data for this long after it last did, in the shares of egress.total_rate_bytes,
# which are worked out again at most this often.
MOVING_S = 1.0
SHARE_REFRESH_S = 0.25
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


TLS_READ_BYTES = 64 << 10

_REASONS = {400: "Bad Request", 403: "Forbidden", 502: "Bad Gateway", 503: "Service Unavailable",
            504: "Gateway Timeout"}


def _answer(status: int, kind: str, message: str) -> bytes:
    body = (message.replace("\r", " ").replace("\n", " ") + "\n").encode()
    return (f"HTTP/1.1 {status} {_REASONS[status]}\r\nX-Sandboxd-Egress: {kind}\r\n"
            f"Content-Type: text/plain; charset=utf-8\r\nContent-Length: {len(body)}\r\n"
            "Connection: close\r\n\r\n").encode() + body


class EgressProxy:
    """The policy, the resolver and the counters every sandbox's session shares."""

    def __init__(self, config: EgressConfig, *, browser_relay: BrowserRelay | None = None,
                 resolve: Resolve | None = None) -> None:
        # Not the default executor: a tool asking for slow names must not hold the threads other work runs on.
        self._dns = concurrent.futures.ThreadPoolExecutor(max_workers=DNS_THREADS, thread_name_prefix="sandboxd-dns")
        self._resolve = resolve or self._getaddrinfo
        self._host_addresses: frozenset[IPAddress] = frozenset()
        self._host_addresses_at = float("-inf")
        self.decisions: collections.Counter[tuple[str, str]] = collections.Counter()  # (decision, reason) → count
        self.secret_uses: collections.Counter[str] = collections.Counter()  # egress.secrets name → substitutions
        self.reconfigure(config)
        self.browser_relay = browser_relay  # integrations.browser_relay: set again on reload
        self._moving: dict[object, float] = {}  # each sandbox's budget → when it last moved bytes
        self._share, self._share_at = float(config.rate_bytes), float("-inf")

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
        # The hosts whose https:// requests the proxy makes itself (the TLS its own).
        self.secret_hosts = tuple(entry for name, hosts in config.secrets.items()
                                  for entry in parse_secret_hosts(name, hosts))
        self._tls: ssl.SSLContext | None = None  # made at the first use: loading the trust store takes a while

    @property
    def tls(self) -> ssl.SSLContext:
        """How the proxy checks a secret's host: the host's trust store, and egress.ca_file."""
        if self._tls is None:
            ca_file = self.config.ca_file
            self._tls = ssl.create_default_context(cafile=str(ca_file) if ca_file else None)
            if ca_file:  # besides the host's own trust store, which cafile= alone would replace
                self._tls.load_default_certs()
            self._tls.set_alpn_protocols(["http/1.1"])
        return self._tls

    def session(self, user: str, sandbox_id: str, context: EgressContext) -> EgressSession:
        return EgressSession(self, user, sandbox_id, context)

    def share(self, now: float) -> float:
        """Bytes a second one sandbox moving data may move now: egress.rate_bytes, and no more than an
        equal share of egress.total_rate_bytes among the sandboxes that moved data in the last MOVING_S."""
        if now - self._share_at > SHARE_REFRESH_S:
            self._share_at = now
            for budget in [b for b, at in self._moving.items() if now - at > MOVING_S]:
                del self._moving[budget]
            total, rate = self.config.total_rate_bytes, float(self.config.rate_bytes)
            self._share = rate if total is None else min(rate, total / max(1, len(self._moving)))
        return self._share

    def moving(self, budget: object, now: float) -> None:
        self._moving[budget] = now

    def forget(self, budget: object) -> None:
        self._moving.pop(budget, None)

    @property
    def sandboxes_moving(self) -> int:
        return len(self._moving)

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
        addresses = [literal] if literal is not None else await self.lookup(host, port, lookups)
        verdicts = [(address, policy.for_address(host, port, address)) for address in addresses]
        allowed = [address for address, verdict in verdicts if verdict.allowed]
        if allowed:
            return allowed, next(verdict for _, verdict in verdicts if verdict.allowed)
        return [], verdicts[0][1] if len(verdicts) == 1 else _first_refusal(verdicts)

    async def lookup(self, host: str, port: int, lookups: asyncio.Semaphore) -> list[IPAddress]:
        """The addresses of the name ``host`` (``lookups`` bounds the sandbox's lookups in flight, see
        ``decide``); raises _Refused when it does not resolve (in time)."""
        try:
            async with asyncio.timeout(self.config.connect_timeout_ms / 1000):
                await lookups.acquire()
                lookup = asyncio.ensure_future(self._resolve(host, port))
                lookup.add_done_callback(_release_after(lookups))
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
        return addresses


def _release_after(lookups: asyncio.Semaphore) -> Callable[[asyncio.Future[list[IPAddress]]], None]:
    """The lookup's thread is done: its slot is free (and a failure it raised is retrieved, not warned about)."""

    def done(lookup: asyncio.Future[list[IPAddress]]) -> None:
        lookups.release()
        if not lookup.cancelled():
            lookup.exception()

    return done


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
    """One sandbox's egress: the connections it opens on its egress.sock (at most
    ``egress.connect_rate`` new ones a second, ``egress.max_connections`` at once), each one request."""

    def __init__(self, proxy: EgressProxy, user: str, sandbox_id: str, context: EgressContext) -> None:
        self._proxy = proxy
        self.user = user
        self.sandbox_id = sandbox_id
        self._context = context
        self._connections: set[asyncio.Task[None]] = set()
        self.budget = _Share(proxy)
        self._accepts = _Debt()
        self._lookups = asyncio.Semaphore(LOOKUPS_PER_SANDBOX)

    def __repr__(self) -> str:
        return f"<EgressSession {self.user} {self.sandbox_id} connections={len(self._connections)}>"

    @property
    def connections(self) -> int:
        return len(self._connections)

    async def serve(self, listener: socket.socket, is_sandbox: Callable[[PeerCredentials], bool]) -> None:
        """Accept the sandbox's connections on ``listener`` until cancelled; only the sandbox may connect.

        Past ``egress.connect_rate`` the next accept waits: the kernel's backlog holds what
        comes meanwhile, and then the sandbox's connects fail at once (EAGAIN), at no cost
        to the daemon, instead of being accepted and refused one by one. A refused connection
        spends ``egress.refusal_cost`` of that rate (``_refused``)."""
        loop = asyncio.get_running_loop()
        while True:
            # The sandbox's share of the daemon's descriptors (service/fds.py): past it, the next accept
            # waits for one of its connections to close, and the kernel's backlog holds the newcomer.
            while len(self._connections) >= self._proxy.config.max_connections + EGRESS_REFUSING:
                await asyncio.wait(list(self._connections), return_when=asyncio.FIRST_COMPLETED)
            delay = self._accepts.take(self._proxy.config.connect_rate)
            if delay:
                await asyncio.sleep(delay)
            try:
                conn, _ = await loop.sock_accept(listener)
            except OSError as exc:  # out of fds, say: the sandbox's way out stops, the daemon goes on
                log.warning("egress_accept_failed", sandbox=self.sandbox_id, error=str(exc),
                            budget=source("sandbox", self.sandbox_id))
                await asyncio.sleep(1)
                continue
            peer = peer_credentials(conn)
            if not is_sandbox(peer):  # only the sandbox mounts the directory; anyone else is refused
                log.warning("egress_foreign_peer", sandbox=self.sandbox_id, pid=peer.pid, uid=peer.uid,
                            budget=source("sandbox", self.sandbox_id))
                conn.close()
                continue
            task = loop.create_task(self.handle(conn))
            self._connections.add(task)  # counted now: the accepts made before it runs must see it
            task.add_done_callback(self._connections.discard)

    async def handle(self, conn: socket.socket) -> None:
        """Serve one connection from the sandbox; never raises."""
        task = asyncio.current_task()
        assert task is not None
        conn.setblocking(False)
        self._connections.add(task)
        try:
            limit = self._proxy.config.max_connections
            if len(self._connections) > 2 * limit:
                return  # a flood: no answer, the connection just closes
            if len(self._connections) > limit:
                self._record("refused", "too many connections", None, 0, None)
                await _reply(conn, 503, "failed", f"egress refused: this sandbox already holds {limit} egress "
                                                  "connections (egress.max_connections); close some first")
            else:
                await self._serve(conn)
        except (ConnectionError, OSError):
            pass
        except asyncio.CancelledError:
            pass  # the sandbox is going away (close)
        finally:
            self._connections.discard(task)
            conn.close()

    def close(self) -> None:
        """The sandbox is destroyed: end its connections now."""
        for task in list(self._connections):
            task.cancel()
        self._proxy.forget(self.budget)

    async def _serve(self, conn: socket.socket) -> None:
        config = self._proxy.config
        reader = RequestReader()
        try:
            async with asyncio.timeout(HEAD_TIMEOUT_S):
                await _read_head(conn, reader)
            assert reader.head is not None
            if reader.extra:  # a pipelined request, or bytes past the body's end: never forwarded
                raise Malformed("bytes follow the request's end (a second request?); the proxy takes one request "
                                "per connection and forwards nothing it did not parse")
            method, scheme, host, port, forward = _parse(reader.head)
            if scheme == "https" and not names_host(self._proxy.secret_hosts, host, port, self._proxy.policy.ports):
                raise ValueError(f"https://{host}:{port}: https goes through CONNECT host:443, not an absolute "
                                 "https:// request (only egress.secrets hosts are fetched so)")
        except _NoRequest:
            return
        except ValueError as exc:  # Malformed, or what _parse refuses
            self._refused()
            await _reply(conn, 400, "failed", f"egress request malformed: {exc}")
            return
        except TimeoutError:
            self._refused()
            await _reply(conn, 400, "failed", f"egress request malformed: no complete request head within "
                                              f"{HEAD_TIMEOUT_S:g} s")
            return
        # One look at the sandbox's call: what it was granted, and the grant that ends with it.
        call = self._context()
        relaying = host == RELAY_NAME
        if relaying and self._proxy.browser_relay is not None:
            host = self._proxy.browser_relay.host  # what is logged: where the tunnel goes
        try:
            addresses, verdict = await (self._relay_addresses(host, port, call.relay_port) if relaying
                                        else self._proxy.decide(host, port, self._lookups))
        except _Refused as refused:
            self._record("failed", refused.reason, host, port, None)
            await _reply(conn, refused.status, "failed", refused.message)
            return
        if not addresses:
            self._record("refused", verdict.reason, host, port, parse_address(host))
            await _reply(conn, 403, "refused", relay_refusal_message(port, verdict) if relaying
                         else refusal_message(host, port, None, verdict))
            return
        try:
            upstream, address = await _connect(addresses, port, config.connect_timeout_ms)
        except _Refused as refused:
            self._record("failed", refused.reason, host, port, addresses[0])
            await _reply(conn, refused.status, "failed", f"egress to {host}:{port} failed: {refused.message}")
            return
        rewrite = call.stand_ins.rewrite(forward, host, port, self._proxy.policy.ports) if forward else None
        # Admitted by what only this call holds (the relay's port, a secret's value): it ends with the call.
        grant = call.grant if relaying or (rewrite is not None and rewrite.substituted) else None
        task = asyncio.current_task()
        assert task is not None
        if grant is not None and not grant.hold(task):
            upstream.close()
            self._record("refused", GRANT_ENDED, host, port, address)
            await _reply(conn, 403, "refused", f"egress to {host}:{port} refused by sandboxd: {GRANT_ENDED}; "
                                               "a call's grants (its relay port, its secrets) last as long as it runs")
            return
        try:
            if scheme == "https":  # the TLS connection takes the socket over, and closes it
                assert rewrite is not None
                await self._serve_tls(conn, upstream, host, port, address, verdict, rewrite, reader)
            else:
                self._record("allowed", verdict.reason, host, port, address, rewrite)
                try:
                    await self._serve_plain(conn, upstream, rewrite, reader)
                finally:
                    upstream.close()
        finally:
            if grant is not None:
                grant.release(task)

    async def _serve_plain(self, conn: socket.socket, upstream: socket.socket, rewrite: Rewrite | None,
                           reader: RequestReader) -> None:
        """A tunnel (CONNECT: the 200, then the bytes that came after the head, then both ways, raw), or an
        absolute-form http:// request: the head as the proxy wrote it, the body as parsed, then the answer."""
        config = self._proxy.config
        loop = asyncio.get_running_loop()
        try:
            if rewrite is None:
                async with asyncio.timeout(HEAD_TIMEOUT_S):
                    await loop.sock_sendall(conn, b"HTTP/1.1 200 Connection established\r\n\r\n")
                    if reader.early:  # what the sandbox sent after its head: a TLS hello, the tunnel's own
                        await loop.sock_sendall(upstream, reader.early)
                await Relay(conn, upstream, self.budget, config.idle_timeout_s).run()
                return
            async with asyncio.timeout(HEAD_TIMEOUT_S):
                await loop.sock_sendall(upstream, rewrite.head)
            answer = Relay(conn, upstream, self.budget, config.idle_timeout_s, upload=False)

            async def send(data: bytes) -> None:
                await loop.sock_sendall(upstream, data)
                answer.touch()

            await _both(self._send_body(conn, reader, send), answer.run())
        except (TimeoutError, Malformed):
            pass

    async def _serve_tls(self, conn: socket.socket, upstream: socket.socket, host: str, port: int,
                         address: IPAddress, verdict: Verdict, rewrite: Rewrite, reader: RequestReader) -> None:
        """An absolute-form https:// request: TLS to the origin (its certificate verified for ``host``), the
        head as rewritten and the body as parsed, then the answer until it ends. Bytes pass through Python
        here, not splice."""
        config = self._proxy.config
        try:
            async with asyncio.timeout(config.connect_timeout_ms / 1000):
                tls_in, tls_out = await asyncio.open_connection(sock=upstream, ssl=self._proxy.tls,
                                                                server_hostname=host)
        except (TimeoutError, OSError, ssl.SSLError) as exc:
            upstream.close()
            why = "the TLS handshake took too long" if isinstance(exc, TimeoutError) else _tls_failure(exc)
            self._record("failed", "tls failed", host, port, address)
            await _reply(conn, 502, "failed", f"egress to {host}:{port} failed: {why}")
            return
        self._record("allowed", verdict.reason, host, port, address, rewrite)
        loop = asyncio.get_running_loop()
        idle = config.idle_timeout_s

        async def send(data: bytes) -> None:
            tls_out.write(data)
            await tls_out.drain()

        async def request() -> None:
            await self._paced(len(rewrite.head))
            await send(rewrite.head)
            await self._send_body(conn, reader, send)

        async def answer() -> None:
            while True:
                async with asyncio.timeout(idle):
                    data = await tls_in.read(TLS_READ_BYTES)
                if not data:
                    break
                await self._paced(len(data))
                async with asyncio.timeout(idle):
                    await loop.sock_sendall(conn, data)
            conn.shutdown(socket.SHUT_WR)

        try:
            await _both(request(), answer())
        except (TimeoutError, OSError, ssl.SSLError, Malformed):
            pass
        finally:
            tls_out.close()

    async def _send_body(self, conn: socket.socket, reader: RequestReader,
                         send: Callable[[bytes], Awaitable[None]]) -> None:
        """The request's body as the parser framed it, within the sandbox's budget, and nothing after its
        end: once the request is complete, the sandbox's connection is not read again (egress/http1.py)."""
        loop = asyncio.get_running_loop()
        while True:
            body = reader.take_body()
            if body:
                await self._paced(len(body))
                await send(body)
            if reader.complete:
                return
            data = await loop.sock_recv(conn, TLS_READ_BYTES)
            if not data:
                raise Malformed("the connection ended inside the request body")
            reader.feed(data)

    async def _paced(self, size: int) -> None:
        """Spend ``size`` bytes of the sandbox's egress budget, waiting first if it is short."""
        wait = self.budget.refill_time(size)
        if wait > 0:
            await asyncio.sleep(wait)
        self.budget.spend(size)

    async def _relay_addresses(self, host: str, port: int, call_port: int | None) -> tuple[list[IPAddress], Verdict]:
        """The browser relay's addresses, when the running call was granted ``port`` (its ``call_port``,
        browser_relay.py); ``[]`` when refused. The operator named the host: the egress policy does not
        judge it, but a name still resolves within the sandbox's lookups."""
        verdict = tunnel_verdict(self._proxy.browser_relay, port, call_port)
        if not verdict.allowed:
            return [], verdict
        literal = parse_address(host)
        return [literal] if literal is not None else await self._proxy.lookup(host, port, self._lookups), verdict

    def _refused(self) -> None:
        """A connection the proxy answers with a refusal: the daemon's answer is all the work done for
        it, so it spends ``egress.refusal_cost`` of the sandbox's accepts (a flood of refused
        connections gets a fifth of the accepts, and costs the daemon a fifth as much)."""
        self._accepts.owe(self._proxy.config.refusal_cost - 1)

    def _record(self, decision: str, reason: str, host: str | None, port: int, address: IPAddress | None,
                rewrite: Rewrite | None = None) -> None:
        if decision == "refused":
            self._refused()
        call = self._context()
        self._proxy.decisions[(decision, _reason_label(reason))] += 1
        named = {}  # never the values: the names of the secrets put in, and of stand-ins sent elsewhere
        if rewrite is not None and rewrite.substituted:
            named["secrets"] = list(rewrite.substituted)
            self._proxy.secret_uses.update(rewrite.substituted)
        if rewrite is not None and rewrite.misdirected:
            named["stand_ins_misdirected"] = list(rewrite.misdirected)
        with masking(call.secrets):  # a tool could put its token in a host name
            log.info("egress", user=self.user, sandbox=self.sandbox_id, tool=call.tool, host=host, port=port,
                     address=str(address) if address is not None else None, decision=decision, reason=reason,
                     **named, budget=source("sandbox", self.sandbox_id))


class _NoRequest(Exception):
    """The sandbox closed the connection without sending a byte: nothing to answer."""


async def _read_head(conn: socket.socket, reader: RequestReader) -> None:
    """Feed ``reader`` until it has the request head (and what came with it); Malformed says what is wrong."""
    loop = asyncio.get_running_loop()
    received = False
    while reader.head is None:
        chunk = await loop.sock_recv(conn, 4096)
        if not chunk:
            if received:
                raise Malformed("the connection ended inside the request head")
            raise _NoRequest
        received = True
        reader.feed(chunk)


async def _both(request: Awaitable[None], answer: Awaitable[None]) -> None:
    """The request's body goes up while the answer comes down (a 100 Continue, an early 413). The answer's
    end ends both; a request that breaks (a malformed body, the sandbox gone) ends the answer too, since
    the origin would wait for the rest of it."""
    sending, answering = asyncio.ensure_future(request), asyncio.ensure_future(answer)
    try:
        done, _ = await asyncio.wait({sending, answering}, return_when=asyncio.FIRST_COMPLETED)
        if sending in done:
            sending.result()  # raises what broke the request
            await answering
    finally:
        for task in (sending, answering):
            task.cancel()
        await asyncio.gather(sending, answering, return_exceptions=True)


async def _connect(addresses: list[IPAddress], port: int, timeout_ms: int) -> tuple[socket.socket, IPAddress]:
    """A connected non-blocking socket to the first of ``addresses`` that answers (all allowed by the policy)."""
    loop = asyncio.get_running_loop()
    last = "no address"
    try:
        async with asyncio.timeout(timeout_ms / 1000):
            for address in addresses:  # only addresses the policy allowed: never a new lookup
                sock = socket.socket(socket.AF_INET6 if address.version == 6 else socket.AF_INET, socket.SOCK_STREAM)
                try:
                    sock.setblocking(False)
                    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # as asyncio's own transports do
                    await loop.sock_connect(sock, (str(address), port))
                    return sock, address
                except OSError as exc:
                    sock.close()
                    last = os.strerror(exc.errno) if exc.errno else str(exc)
                except BaseException:
                    sock.close()
                    raise
    except TimeoutError:
        raise _Refused(504, f"connecting took longer than {timeout_ms} ms (egress.connect_timeout_ms)",
                       reason="connect timeout") from None
    raise _Refused(502, last.lower() if last else "connection failed", reason="connect failed")


async def _reply(conn: socket.socket, status: int, kind: str, message: str) -> None:
    """Answer and end the request: the answer, then EOF, then what the client still sends is read and dropped
    (briefly: closing over unread bytes would reset the connection, and the client would see a reset
    instead of the answer)."""
    loop = asyncio.get_running_loop()
    try:
        async with asyncio.timeout(HEAD_TIMEOUT_S):
            await loop.sock_sendall(conn, _answer(status, kind, message))
        conn.shutdown(socket.SHUT_WR)
        async with asyncio.timeout(1.0):
            await loop.sock_recv(conn, MAX_HEAD_BYTES)
    except (TimeoutError, OSError):
        pass


def _reason_label(reason: str) -> str:
    """A bounded label for the metrics: the reason's class, without hosts, entries, ranges or
    the IPv6 form an IPv4 address came in (egress/addresses.py: "words (source), inside ...")."""
    if reason.startswith("egress.allow entry"):
        return "egress.allow"
    if reason.startswith("port "):
        return "port not allowed"
    return reason.split(" (")[0].split(", ")[0].split(":")[0]


def _tls_failure(exc: BaseException) -> str:
    if isinstance(exc, ssl.SSLCertVerificationError):
        return f"its TLS certificate was not accepted ({exc.verify_message}); egress.ca_file adds a CA to trust"
    return f"the TLS connection failed ({exc})"


def _parse(head: Head) -> tuple[str, str, str, int, bytes]:
    """(method, scheme, host, port, the request head to forward or b"") from a parsed head; ValueError says
    what is wrong. The head forwarded is written here from what was parsed, never the sandbox's bytes."""
    method, target = head.method, head.target
    if method == "CONNECT":
        host, port = _authority(target)
        return method, "", host, port, b""
    url = urlsplit(target)
    if url.scheme not in ("http", "https") or not url.netloc:
        raise ValueError(f"{target[:200]!r} is neither CONNECT host:port nor an absolute http:// URL")
    default_port = 443 if url.scheme == "https" else 80
    host, port = _authority(url.netloc if ":" in url.netloc.rsplit("]", 1)[-1] else f"{url.netloc}:{default_port}")
    if host == RELAY_NAME:
        raise ValueError(f"the browser relay is reached with CONNECT {RELAY_NAME}:PORT, not {method}")
    path = url.path or "/"
    if url.query:
        path += "?" + url.query
    # Host is the URL's, whatever the request said (RFC 9112, 3.2.2): a Host of its own would let a tool
    # send a request checked for one name to another site on the same server (a CDN's), secrets and all.
    headers = [name + b": " + value for name, value in head.headers if name.lower() not in _HOP_HEADERS | {b"host"}]
    headers.insert(0, b"Host: " + url.netloc.encode())
    forward = b"\r\n".join([f"{method} {path} HTTP/1.1".encode(), *headers, b"Connection: close", b"", b""])
    return method, url.scheme, host, port, forward


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


class _Share:
    """One sandbox's egress bytes, both ways: a token bucket at ``egress.rate_bytes`` a second, and
    never more than an equal share of ``egress.total_rate_bytes`` among the sandboxes moving data
    now (the proxy's ``share``); one second's worth at once."""

    def __init__(self, proxy: EgressProxy) -> None:
        self._proxy = proxy
        self._tokens = float(proxy.config.rate_bytes)
        self._at = time.monotonic()

    def _refill(self, now: float) -> float:
        rate = self._proxy.share(now)
        self._tokens = min(rate, self._tokens + (now - self._at) * rate)
        self._at = now
        return rate

    def available(self) -> float:
        self._refill(time.monotonic())
        return self._tokens

    def refill_time(self, size: float) -> float:
        rate = self._refill(time.monotonic())
        return max(0.0, (size - self._tokens) / rate)

    def spend(self, size: int) -> None:
        now = time.monotonic()
        self._refill(now)
        self._tokens -= size
        self._proxy.moving(self, now)


class _Debt:
    """A token bucket that lends: ``take`` always takes one and says how long to wait to have paid it back
    (new egress connections: ``egress.connect_rate`` a second, a second's worth at once)."""

    def __init__(self) -> None:
        self._tokens: float | None = None
        self._at = time.monotonic()

    def take(self, rate: float) -> float:
        now = time.monotonic()
        tokens = rate if self._tokens is None else min(rate, self._tokens + (now - self._at) * rate)
        self._tokens, self._at = tokens - 1, now
        return 0.0 if self._tokens >= 0 else -self._tokens / rate

    def owe(self, count: float) -> None:
        """Spend ``count`` more on what was taken last: the next ``take`` waits for it too."""
        if self._tokens is not None:
            self._tokens -= count
