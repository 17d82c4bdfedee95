"""Secrets a sandbox never holds (``egress.secrets``): stand-ins in its env, real values on the wire.

For a call env name that ``egress.secrets`` lists, the sandbox gets a stand-in (fresh for
each call) instead of the value. The egress proxy reads the head of each request it
forwards in absolute form (``GET http://…`` or ``GET https://…``: the shim sends requests
to a secret's hosts that way) and, only when the request goes to one of that secret's
hosts, puts the real value where the stand-in was: in any header (also inside
``Authorization: Basic``'s base64) and in the URL's query, literally or percent-encoded.
Only over TLS (the proxy's own, to the origin): a plain ``http://`` request that carries a
stand-in to the secret's host is refused, unless an entry written ``http://host:port`` lets
the value cross the network in clear (``allow_unsafe: [secrets_in_clear]``).
Never in a body, never in the path, never inside a CONNECT tunnel (it cannot read one).
A stand-in in a request to any other host goes on as it is: it is worth nothing there,
and it is logged and counted as misdirected. docs/security.md ("Secrets") says why.
What comes back is egress/echoes.py's: the value in an answer becomes the stand-in again.
"""

from __future__ import annotations

import base64
import binascii
import re
import secrets as random
from dataclasses import dataclass, field, replace
from typing import Iterable, Mapping
from urllib.parse import quote

from sandboxd.rules.policy import AllowEntry, parse_address

STAND_IN_PREFIX = "sandboxd-stand-in-"
# An egress.secrets entry written so lets the value go in plain HTTP (allow_unsafe: [secrets_in_clear]).
CLEAR_SCHEME = "http://"
_CONTROL = re.compile(r"[\x00-\x1f\x7f]")


def parse_secret_hosts(name: str, hosts: list[str]) -> tuple[AllowEntry, ...]:
    """The entries of one ``egress.secrets`` item (``http://`` ones too); ValueError naming the secret and the problem."""
    if not hosts:
        raise ValueError(f"{name}: name at least one host its value may be sent to, "
                         'e.g. {"' + name + '": ["api.example.com"]}')
    return tuple(_parse_entry(name, host) for host in hosts)


def clear_hosts(name: str, hosts: list[str]) -> tuple[AllowEntry, ...]:
    """The entries written ``http://host[:port]``: where the value may also go in plain HTTP (port 80 if none)."""
    return tuple(_parse_entry(name, host) for host in hosts if host.strip().lower().startswith(CLEAR_SCHEME))


def _parse_entry(name: str, text: str) -> AllowEntry:
    clear = text.strip().lower().startswith(CLEAR_SCHEME)
    try:
        entry = AllowEntry.parse(text.strip()[len(CLEAR_SCHEME):] if clear else text)
    except ValueError as exc:
        raise ValueError(f"{name}: {str(exc).replace('egress.allow entry', 'entry')}") from None
    if clear and entry.port is None:
        return replace(entry, port=80)  # plain HTTP's port: the entry names no other
    return entry


def value_problem(name: str, value: str) -> str | None:
    """Why an egress secret's value cannot be used (naming the variable, never the value), or None.

    A control character could not go into a header: a line break there would end it and
    start one of the sandbox's making."""
    if _CONTROL.search(value):
        return (f"{name} is an egress secret (egress.secrets) and may not hold control characters "
                "(line breaks, tabs, NUL): its value goes into HTTP headers")
    return None


def names_host(entries: Iterable[AllowEntry], host: str, port: int, ports: frozenset[int]) -> bool:
    """Does one of ``entries`` name ``host:port`` (lower case, as the proxy parsed it)?

    Names match name entries (``*.`` for subdomains), IP literals match network entries;
    a name is never matched through the addresses it resolves to. Without a port, an
    entry means the ports in egress.ports, as in egress.allow."""
    literal = parse_address(host)
    for entry in entries:
        if not entry.allows_port(port, ports):
            continue
        if entry.matches_name(host) or (literal is not None and entry.network is not None
                                        and literal in entry.network):
            return True
    return False


@dataclass(frozen=True)
class Secret:
    """One call's secret: its env name, the real value, the stand-in the sandbox holds, and its hosts."""

    name: str
    value: str
    stand_in: str
    hosts: tuple[AllowEntry, ...]
    clear: tuple[AllowEntry, ...] = ()  # the hosts it may reach in plain HTTP (CLEAR_SCHEME entries)
    _pattern: re.Pattern[bytes] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "_pattern", _stand_in_pattern(self.stand_in))

    def belongs_to(self, host: str, port: int, ports: frozenset[int]) -> bool:
        return names_host(self.hosts, host, port, ports)

    def goes_to(self, host: str, port: int, ports: frozenset[int], tls: bool) -> bool:
        """May the value go into a request to ``host:port``: over TLS to its hosts, in clear to its http:// ones."""
        return names_host(self.hosts if tls else self.clear, host, port, ports)

    def found_in(self, data: bytes) -> bool:
        return self._pattern.search(data) is not None

    def replace(self, data: bytes, literal: bytes) -> tuple[bytes, int]:
        """``data`` with each stand-in replaced: written as is by ``literal``, percent-encoded by the
        value percent-encoded (a client that encoded the stand-in wants the value encoded too)."""
        encoded = quote(self.value, safe="").encode()
        return self._pattern.subn(lambda m: literal if m.group(0) == self.stand_in.encode() else encoded, data)


def _stand_in_pattern(stand_in: str) -> re.Pattern[bytes]:
    """The stand-in with each character as it is or percent-encoded (either hex case)."""
    parts = []
    for char in stand_in:
        hexes = "".join(f"[{d}{d.lower()}]" if d.isalpha() else d for d in f"{ord(char):02X}")
        parts.append(f"(?:{re.escape(char)}|%{hexes})")
    return re.compile("".join(parts).encode())


@dataclass(frozen=True)
class Rewrite:
    head: bytes
    substituted: tuple[str, ...] = ()  # names whose value went into the head
    misdirected: tuple[str, ...] = ()  # names whose stand-in was in a request to another host
    own: tuple[Secret, ...] = ()  # the secrets whose value may go to this host: its answer is scrubbed of them


class StandIns:
    """One call's secrets, behind the stand-ins its sandbox holds."""

    def __init__(self, items: Iterable[Secret] = ()) -> None:
        self.secrets = tuple(items)

    def __bool__(self) -> bool:
        return bool(self.secrets)

    @classmethod
    def for_call(cls, env: Mapping[str, str], config: Mapping[str, list[str]]) -> tuple[dict[str, str], StandIns]:
        """The env the sandbox gets (a stand-in for each value ``config`` names) and the stand-ins.
        The values passed ``value_problem`` (tools/call's params check)."""
        sandbox_env, items = dict(env), []
        for name, value in env.items():
            if name not in config:
                continue
            stand_in = f"{STAND_IN_PREFIX}{random.token_hex(16)}"
            hosts = config[name]
            items.append(Secret(name, value, stand_in, parse_secret_hosts(name, hosts), clear_hosts(name, hosts)))
            sandbox_env[name] = stand_in
        return sandbox_env, cls(items)

    def shim_hosts(self) -> list[dict[str, object]]:
        """The hosts whose requests the shim must send in absolute form (docs/shim.md, "call")."""
        found: list[dict[str, object]] = []
        for secret in self.secrets:
            for entry in secret.hosts:
                item: dict[str, object] = {"port": entry.port}
                if entry.host is not None:
                    item["host"] = entry.host
                else:
                    item["network"] = str(entry.network)
                if item not in found:
                    found.append(item)
        return found

    def held_back(self, head: bytes, host: str, port: int, ports: frozenset[int]) -> tuple[str, ...]:
        """The names whose stand-in is in ``head``, a plain-HTTP request to one of their hosts that may not
        get the value in clear: the proxy refuses it rather than send it on (docs/security.md, "Secrets")."""
        return tuple(s.name for s in self.secrets if s.belongs_to(host, port, ports)
                     and not s.goes_to(host, port, ports, tls=False) and s.found_in(head))

    def rewrite(self, head: bytes, host: str, port: int, ports: frozenset[int], *, tls: bool) -> Rewrite:
        """``head`` (request line and headers, as the proxy forwards them) with the stand-ins of the
        secrets that belong to ``host:port`` replaced by their values in the query and the headers;
        without ``tls`` only those of the secrets an ``http://`` entry lets go in clear.
        The proxy wrote ``head`` itself from what its parser read (egress/http1.py), so every CRLF in
        it ends a line for the origin too, and no value holds a control character (value_problem)."""
        if not self.secrets:
            return Rewrite(head)
        own = tuple(s for s in self.secrets if s.goes_to(host, port, ports, tls))
        misdirected = tuple(s.name for s in self.secrets
                            if not s.belongs_to(host, port, ports) and s.found_in(head))
        if not own:
            return Rewrite(head, misdirected=misdirected)
        lines = head.split(b"\r\n")
        used: set[str] = set()
        lines[0] = _rewrite_query(lines[0], own, used)
        for i in range(1, len(lines)):
            if lines[i][:16].lower() == b"accept-encoding:":  # an answer the proxy can read for values (echoes.py)
                lines[i] = b"Accept-Encoding: identity"
            elif b":" in lines[i]:
                lines[i] = _rewrite_header(lines[i], own, used)
        return Rewrite(b"\r\n".join(lines), tuple(s.name for s in own if s.name in used), misdirected, own)


# A call without secrets (most calls), and an idle sandbox: one, never changed.
NO_STAND_INS = StandIns()


def _rewrite_query(request_line: bytes, own: tuple[Secret, ...], used: set[str]) -> bytes:
    method, _, rest = request_line.partition(b" ")
    target, _, version = rest.rpartition(b" ")
    path, mark, query = target.partition(b"?")
    if not mark:
        return request_line
    for secret in own:  # in a URL even the literal stand-in becomes the encoded value
        query, count = secret.replace(query, quote(secret.value, safe="").encode())
        if count:
            used.add(secret.name)
    return b" ".join([method, path + mark + query, version])


def _rewrite_header(line: bytes, own: tuple[Secret, ...], used: set[str]) -> bytes:
    name, _, value = line.partition(b":")
    for secret in own:
        value, count = secret.replace(value, secret.value.encode())
        if count:
            used.add(secret.name)
    if name.strip().lower() == b"authorization":
        value = _rewrite_basic(value, own, used)
    return name + b":" + value


def _rewrite_basic(value: bytes, own: tuple[Secret, ...], used: set[str]) -> bytes:
    """``Basic base64(user:password)``: the stand-in inside the credentials, replaced and encoded again."""
    scheme, _, token = value.strip().partition(b" ")
    if scheme.lower() != b"basic" or not token.strip():
        return value
    try:
        credentials = base64.b64decode(token.strip(), validate=True)
    except (binascii.Error, ValueError):
        return value
    changed = False
    for secret in own:
        if secret.stand_in.encode() in credentials:
            credentials = credentials.replace(secret.stand_in.encode(), secret.value.encode())
            used.add(secret.name)
            changed = True
    return b" " + scheme + b" " + base64.b64encode(credentials) if changed else value
