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
  ``egress.ca_file``), so that it can put the secrets' values in (rules/secrets.py).

The name is resolved here, every address checked (rules/policy.py), and the
connection made to a checked address only. A connection admitted by what only the running
call was granted (the browser relay's port, a secret's value put in) ends when the call is
answered (egress/grants.py). A refusal answers 403 with
``X-Sandboxd-Egress: refused`` and one line saying why and who can change it; a
failure (no such name, refused, timed out) 502/504 with ``X-Sandboxd-Egress: failed``.
docs/security.md ("The network boundary") says what this stops and what it does not.

This module holds what every sandbox shares: the policy, name lookups, the shares of
egress.total_rate_bytes, the TLS context. One sandbox's connections are egress/session.py's;
a request's head, read and checked, and the proxy's own answers are egress/request.py's.
"""
from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import ipaddress
import socket
import ssl
import time
import weakref
from typing import Awaitable, Callable

from sandboxd.config import EgressConfig
from sandboxd.egress.contract import EgressContext
from sandboxd.egress.request import Refused
from sandboxd.egress.session import EgressSession
from sandboxd.logging import get_logger
from sandboxd.rules.browser_relay import BrowserRelay
from sandboxd.rules.policy import EgressPolicy, IPAddress, Verdict, host_addresses, parse_address
from sandboxd.rules.secrets import parse_secret_hosts

log = get_logger("sandboxd.egress")


HOST_ADDRESSES_TTL_S = 60.0
# A sandbox counts as moving data for this long after it last did, in the shares of egress.total_rate_bytes,
# which are worked out again at most this often.
MOVING_S = 1.0
SHARE_REFRESH_S = 0.25
# Lookups can block for the resolver's whole timeout: a pool of their own, and at most LOOKUPS_PER_USER
# of them per user, all their sandboxes together, so one user's slow names leave the other six to everyone else.
DNS_THREADS = 8
LOOKUPS_PER_USER = 2

Resolve = Callable[[str, int], Awaitable[list[IPAddress]]]  # name, port → addresses; OSError if none


class EgressProxy:
    """The policy, the resolver and the counters every sandbox's session shares."""

    def __init__(self, config: EgressConfig, *, browser_relay: BrowserRelay | None = None,
                 resolve: Resolve | None = None) -> None:
        # Not the default executor: a tool asking for slow names must not hold the threads other work runs on.
        self._dns = concurrent.futures.ThreadPoolExecutor(max_workers=DNS_THREADS, thread_name_prefix="sandboxd-dns")
        # Taken before a lookup starts, so none queues in the executor past its request's deadline.
        self._dns_threads = asyncio.Semaphore(DNS_THREADS)
        self._user_lookups: weakref.WeakValueDictionary[str, asyncio.Semaphore] = weakref.WeakValueDictionary()
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

    def lookups_of(self, user: str) -> asyncio.Semaphore:
        """The bound on ``user``'s lookups in flight, one for all their sandboxes (kept while any holds it)."""
        lookups = self._user_lookups.get(user)
        if lookups is None:
            lookups = self._user_lookups[user] = asyncio.Semaphore(LOOKUPS_PER_USER)
        return lookups

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

        ``lookups`` bounds the user's lookups in flight (``lookups_of``), counted until each one's thread
        is done (a timed-out lookup still holds a thread). Raises Refused for a name that does
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
        """The addresses of the name ``host`` (``lookups`` bounds the user's lookups in flight, see
        ``decide``); raises Refused when it does not resolve (in time)."""
        try:
            async with asyncio.timeout(self.config.connect_timeout_ms / 1000):
                await lookups.acquire()  # the user's own turn first: their queue never holds a thread
                try:
                    await self._dns_threads.acquire()
                except BaseException:
                    lookups.release()
                    raise
                lookup = asyncio.ensure_future(self._resolve(host, port))
                lookup.add_done_callback(_release_after(lookups, self._dns_threads))
                addresses = await asyncio.shield(lookup)
        except TimeoutError:
            raise Refused(504, f"egress to {host}:{port} failed: resolving the name took longer than "
                                f"{self.config.connect_timeout_ms} ms (egress.connect_timeout_ms)",
                           reason="resolve timeout") from None
        except (OSError, UnicodeError) as exc:
            raise Refused(502, f"egress to {host}:{port} failed: the name does not resolve ({exc})",
                           reason="name does not resolve") from None
        if not addresses:
            raise Refused(502, f"egress to {host}:{port} failed: the name has no address",
                           reason="name does not resolve")
        return addresses


def _release_after(lookups: asyncio.Semaphore, threads: asyncio.Semaphore) -> Callable[[asyncio.Future[list[IPAddress]]], None]:
    """The lookup's thread is done: it and the user's slot are free (and a failure it raised is retrieved, not warned about)."""

    def done(lookup: asyncio.Future[list[IPAddress]]) -> None:
        threads.release()
        lookups.release()
        if not lookup.cancelled():
            lookup.exception()

    return done


def _first_refusal(verdicts: list[tuple[IPAddress, Verdict]]) -> Verdict:
    address, verdict = verdicts[0]
    return Verdict(False, f"{verdict.reason} ({address}, and every other address of the name)")
