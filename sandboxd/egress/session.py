"""One sandbox's way out (``EgressSession``): its connections, each one request read, checked,
connected and relayed (the proxy's module docstring, egress/proxy.py, says how)."""

from __future__ import annotations

import asyncio
import collections
import os
import socket
import ssl
from typing import Awaitable, Callable, Protocol

from sandboxd.egress.contract import EgressContext
from sandboxd.egress.echoes import AnswerScrubber
from sandboxd.egress.grants import GRANT_ENDED
from sandboxd.egress.http1 import Malformed, RequestReader
from sandboxd.egress.pacing import Debt, Share, Shares
from sandboxd.egress.relay import UNSENT_BYTES, Relay
from sandboxd.egress.request import (HEAD_TIMEOUT_S, NoRequest, Refused, parse_request, read_head, refusal_message,
                                     reply)
from sandboxd.logging import get_logger, masking, source
from sandboxd.rules.browser_relay import RELAY_NAME, BrowserRelay, relay_refusal_message, tunnel_verdict
from sandboxd.rules.policy import AllowEntry, EgressPolicy, IPAddress, Verdict, parse_address
from sandboxd.rules.secrets import Rewrite, StandIns, names_host
from sandboxd.rules.tool_network import ToolNetwork
from sandboxd.service.fds import EGRESS_REFUSING
from sandboxd.service.peercred import PeerCredentials, peer_credentials

log = get_logger("sandboxd.egress")

TLS_READ_BYTES = 64 << 10  # read from an origin's TLS stream at once


class SharedEgress(Shares, Protocol):
    """What a session asks of what every sandbox shares: egress/proxy.py's ``EgressProxy``."""

    policy: EgressPolicy
    secret_hosts: tuple[AllowEntry, ...]
    browser_relay: BrowserRelay | None
    decisions: collections.Counter[tuple[str, str]]
    secret_uses: collections.Counter[str]

    @property
    def tls(self) -> ssl.SSLContext: ...

    def lookups_of(self, user: str) -> asyncio.Semaphore: ...

    async def decide(self, host: str, port: int, lookups: asyncio.Semaphore) -> tuple[list[IPAddress], Verdict]: ...

    async def lookup(self, host: str, port: int, lookups: asyncio.Semaphore) -> list[IPAddress]: ...

    def forget(self, budget: object) -> None: ...


class EgressSession:
    """One sandbox's egress: the connections it opens on its egress.sock (at most
    ``egress.connect_rate`` new ones a second, ``egress.max_connections`` at once), each one request."""

    def __init__(self, proxy: SharedEgress, user: str, sandbox_id: str, context: EgressContext) -> None:
        self._proxy = proxy
        self.user = user
        self.sandbox_id = sandbox_id
        self._context = context
        self._connections: set[asyncio.Task[None]] = set()
        self.budget = Share(proxy)
        self._accepts = Debt()
        self._lookups = proxy.lookups_of(user)  # one bound for all the user's sandboxes (egress/proxy.py)

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
                await reply(conn, 503, "failed", f"egress refused: this sandbox already holds {limit} egress "
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
        """One request: read and checked, its destination decided and connected, then served; every
        refusal and failure is answered in the phase that finds it."""
        request = await self._read_request(conn)
        if request is None:
            return
        reader, scheme, host, port, forward = request
        call = self._context()  # one look at the sandbox's call: what it was granted, and the grant that ends with it
        relaying = host == RELAY_NAME
        if await self._undeclared(conn, call.network, host, port, relaying):
            return
        if scheme == "http" and await self._held_back(conn, call.stand_ins, forward, host, port):
            return
        if relaying and self._proxy.browser_relay is not None:
            host = self._proxy.browser_relay.host  # what is logged: where the tunnel goes
        opened = await self._open(conn, host, port, call.relay_port if relaying else None, relaying)
        if opened is None:
            return
        upstream, address, verdict = opened
        rewrite = (call.stand_ins.rewrite(forward, host, port, self._proxy.policy.ports, tls=scheme == "https")
                   if forward else None)
        # Admitted by what only this call holds (the relay's port, a secret's value): it ends with the call.
        grant = call.grant if relaying or (rewrite is not None and rewrite.substituted) else None
        task = asyncio.current_task()
        assert task is not None
        if grant is not None and not grant.hold(task):
            upstream.close()
            self._record("refused", GRANT_ENDED, host, port, address)
            await reply(conn, 403, "refused", f"egress to {host}:{port} refused by sandboxd: {GRANT_ENDED}; "
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

    async def _read_request(self, conn: socket.socket) -> tuple[RequestReader, str, str, int, bytes] | None:
        """(reader, scheme, host, port, the head to forward or b"") of the sandbox's request; None once a
        malformed one is answered 400, or when the sandbox sent nothing."""
        reader = RequestReader()
        try:
            async with asyncio.timeout(HEAD_TIMEOUT_S):
                await read_head(conn, reader)
            assert reader.head is not None
            if reader.extra:  # a pipelined request, or bytes past the body's end: never forwarded
                raise Malformed("bytes follow the request's end (a second request?); the proxy takes one request "
                                "per connection and forwards nothing it did not parse")
            _method, scheme, host, port, forward = parse_request(reader.head)
            if scheme == "https" and not names_host(self._proxy.secret_hosts, host, port, self._proxy.policy.ports):
                raise ValueError(f"https://{host}:{port}: https goes through CONNECT host:443, not an absolute "
                                 "https:// request (only egress.secrets hosts are fetched so)")
            return reader, scheme, host, port, forward
        except NoRequest:
            return None
        except ValueError as exc:  # Malformed, or what parse_request refuses
            message = f"egress request malformed: {exc}"
        except TimeoutError:
            message = f"egress request malformed: no complete request head within {HEAD_TIMEOUT_S:g} s"
        self._refused()
        await reply(conn, 400, "failed", message)
        return None

    async def _undeclared(self, conn: socket.socket, network: ToolNetwork | None, host: str, port: int,
                          relaying: bool) -> bool:
        """Refuse (403) a request to where the running tool's permissions.network does not reach, before any
        lookup: True once answered; False when the policy decides (rules/tool_network.py). The relay is
        browser: true's, granted per call (rules/browser_relay.py)."""
        if network is None or relaying or network.grant(host, port, self._proxy.policy.ports) is not None:
            return False
        self._record("refused", "not in permissions.network", host, port, None)
        await reply(conn, 403, "refused", network.refusal(host, port, self._proxy.policy.ports))
        return True

    async def _held_back(self, conn: socket.socket, stand_ins: StandIns, head: bytes, host: str, port: int) -> bool:
        """Refuse (403) a plain-HTTP request carrying a stand-in to its secret's host, which would get the
        value in clear: True once answered, before any lookup or connect; False when it may go."""
        names = stand_ins.held_back(head, host, port, self._proxy.policy.ports) if stand_ins else ()
        if not names:
            return False
        self._record("refused", "secret in clear", host, port, None)
        await reply(conn, 403, "refused", f"egress to http://{host}:{port} refused by sandboxd: the request carries "
                                          f"the stand-in of {', '.join(names)} (egress.secrets), whose value goes "
                                          "only over TLS; send it to an https:// URL, or the operator can name "
                                          f"http://{host}:{port} in egress.secrets with allow_unsafe: "
                                          "[secrets_in_clear]")
        return True

    async def _open(self, conn: socket.socket, host: str, port: int, relay_port: int | None,
                    relaying: bool) -> tuple[socket.socket, IPAddress, Verdict] | None:
        """A connection to where the request may go, by the policy (or the call's relay grant); None once a
        refusal or a failure is answered."""
        try:
            addresses, verdict = await (self._relay_addresses(host, port, relay_port) if relaying
                                        else self._proxy.decide(host, port, self._lookups))
        except Refused as refused:
            self._record("failed", refused.reason, host, port, None)
            await reply(conn, refused.status, "failed", refused.message)
            return None
        if not addresses:
            self._record("refused", verdict.reason, host, port, parse_address(host))
            await reply(conn, 403, "refused", relay_refusal_message(port, verdict) if relaying
                         else refusal_message(host, port, None, verdict))
            return None
        try:
            upstream, address = await _connect(addresses, port, self._proxy.config.connect_timeout_ms)
        except Refused as refused:
            self._record("failed", refused.reason, host, port, addresses[0])
            await reply(conn, refused.status, "failed", f"egress to {host}:{port} failed: {refused.message}")
            return None
        return upstream, address, verdict

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
            if rewrite.own:  # a secret's host, in clear (allow_unsafe): its answer is read, not spliced
                await _both(self._send_body(conn, reader, lambda data: loop.sock_sendall(upstream, data)),
                            self._answer(conn, lambda: loop.sock_recv(upstream, TLS_READ_BYTES), rewrite))
                return
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
            await reply(conn, 502, "failed", f"egress to {host}:{port} failed: {why}")
            return
        self._record("allowed", verdict.reason, host, port, address, rewrite)

        async def send(data: bytes) -> None:
            tls_out.write(data)
            await tls_out.drain()

        async def request() -> None:
            await self._paced(len(rewrite.head))
            await send(rewrite.head)
            await self._send_body(conn, reader, send)

        try:
            await _both(request(), self._answer(conn, lambda: tls_in.read(TLS_READ_BYTES), rewrite))
        except (TimeoutError, OSError, ssl.SSLError, Malformed):
            pass
        finally:
            tls_out.close()

    async def _answer(self, conn: socket.socket, read: Callable[[], Awaitable[bytes]], rewrite: Rewrite) -> None:
        """The origin's answer to the sandbox until it ends, within the sandbox's budget; from a host a value may
        go to, with each value that comes back turned into its stand-in (egress/echoes.py)."""
        loop = asyncio.get_running_loop()
        idle = self._proxy.config.idle_timeout_s
        scrubber = AnswerScrubber(rewrite.own) if rewrite.own else None
        try:
            while data := await asyncio.wait_for(read(), idle):
                await self._paced(len(data))
                async with asyncio.timeout(idle):
                    await loop.sock_sendall(conn, scrubber.feed(data) if scrubber is not None else data)
            if scrubber is not None:
                async with asyncio.timeout(idle):
                    await loop.sock_sendall(conn, scrubber.end())
            conn.shutdown(socket.SHUT_WR)
        finally:
            if scrubber is not None and scrubber.found:  # the names only: the values never reach the log
                log.warning("egress_secret_echoed", user=self.user, sandbox=self.sandbox_id,
                            secrets=sorted(scrubber.found), budget=source("sandbox", self.sandbox_id))

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
        judge it, but a name still resolves within the user's lookups."""
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
        named: dict[str, object] = {}  # never the values: the names of the secrets put in, and of stand-ins sent elsewhere
        if rewrite is not None and rewrite.substituted:
            named["secrets"] = list(rewrite.substituted)
            self._proxy.secret_uses.update(rewrite.substituted)
        if rewrite is not None and rewrite.misdirected:
            named["stand_ins_misdirected"] = list(rewrite.misdirected)
        if call.network is not None and host is not None:  # the tool's own grant decided first
            named["grant"] = call.network.decided(host, port, self._proxy.policy.ports)
        with masking(call.secrets):  # a tool could put its token in a host name
            log.info("egress", user=self.user, sandbox=self.sandbox_id, tool=call.tool, host=host, port=port,
                     address=str(address) if address is not None else None, decision=decision, reason=reason,
                     **named, budget=source("sandbox", self.sandbox_id))


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
                    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NOTSENT_LOWAT, UNSENT_BYTES)
                    await loop.sock_connect(sock, (str(address), port))
                    return sock, address
                except OSError as exc:
                    sock.close()
                    last = os.strerror(exc.errno) if exc.errno else str(exc)
                except BaseException:
                    sock.close()
                    raise
    except TimeoutError:
        raise Refused(504, f"connecting took longer than {timeout_ms} ms (egress.connect_timeout_ms)",
                       reason="connect timeout") from None
    raise Refused(502, last.lower() if last else "connection failed", reason="connect failed")


def _reason_label(reason: str) -> str:
    """A bounded label for the metrics: the reason's class, without hosts, entries, ranges or
    the IPv6 form an IPv4 address came in (rules/addresses.py: "words (source), inside ...")."""
    if reason.startswith("egress.allow entry"):
        return "egress.allow"
    if reason.startswith("port "):
        return "port not allowed"
    return reason.split(" (")[0].split(", ")[0].split(":")[0]


def _tls_failure(exc: BaseException) -> str:
    if isinstance(exc, ssl.SSLCertVerificationError):
        return f"its TLS certificate was not accepted ({exc.verify_message}); egress.ca_file adds a CA to trust"
    return f"the TLS connection failed ({exc})"
