"""The cluster's mutual TLS: the contexts of the listener and of a dial, and who a certificate is.

Only the cluster's CA (``cluster.tls.ca``) is trusted, never the system's roots: a certificate
any public CA signed gets nowhere. Both ends must show a certificate, over TLS 1.3 (every
peer is sandboxd on Python 3.11 or later, so no older version is needed). A peer is known
by its certificate's common name, ``KIND:NAME`` (``node:a``, ``router:r1``, ``operator:ops``):
the role says what it may call (cluster/roles.py), not a DNS name, so hostnames are not
checked; a dial checks the role it expects instead (cluster/dial.py). docs/security.md,
"The cluster listener".
"""

from __future__ import annotations

import re
import ssl
from pathlib import Path
from typing import Any, Literal, NamedTuple, get_args

from sandboxd.config.cluster import ClusterTLS
from sandboxd.errors import ConfigError

Kind = Literal["node", "router", "operator"]
KINDS: tuple[str, ...] = get_args(Kind)
# The NAME after the kind: a node's name is a key segment in etcd (config/cluster.py's NODE_NAME).
_ROLE_NAME = re.compile(r"[a-z0-9][a-z0-9.-]{0,62}")


class Role(NamedTuple):
    kind: Kind
    name: str

    def __str__(self) -> str:
        return f"{self.kind}:{self.name}"


class RoleRefused(Exception):
    """A certificate the CA signed, whose subject names no role; ``str()`` says why."""


def role_of(peercert: dict[str, Any] | None) -> Role:
    """The role of a verified peer certificate (``SSLObject.getpeercert()``): its one common name, ``KIND:NAME``.

    RoleRefused for no certificate, no common name or several, or another shape."""
    if not peercert:
        raise RoleRefused("no certificate")
    names = [value for rdn in peercert.get("subject", ()) for key, value in rdn if key == "commonName"]
    if len(names) != 1:
        raise RoleRefused(f"the subject has {len(names)} common names, not one")
    kind, sep, name = names[0].partition(":")
    if not sep or kind not in KINDS or not _ROLE_NAME.fullmatch(name):
        raise RoleRefused(f"common name {names[0]!r} is not node:NAME, router:NAME or operator:NAME")
    return Role(kind, name)


def server_context(tls: ClusterTLS) -> ssl.SSLContext:
    """The listener's: its certificate shown, a client certificate signed by the cluster's CA required."""
    context = _context(ssl.PROTOCOL_TLS_SERVER, tls)
    context.num_tickets = 0  # no session resumption: every connection shows its certificate afresh
    return context


def client_context(tls: ClusterTLS) -> ssl.SSLContext:
    """A dial's: this side's certificate shown, the server's checked against the cluster's CA (its role by the caller)."""
    return _context(ssl.PROTOCOL_TLS_CLIENT, tls)


def _context(protocol: int, tls: ClusterTLS) -> ssl.SSLContext:
    context = ssl.SSLContext(protocol)
    context.minimum_version = ssl.TLSVersion.TLSv1_3
    context.check_hostname = False  # peers are known by the role in their common name, checked after the handshake
    context.verify_mode = ssl.CERT_REQUIRED
    ca, cert, key = (_readable(tls.ca, "cluster.tls.ca"), _readable(tls.cert, "cluster.tls.cert"),
                     _readable(tls.key, "cluster.tls.key"))
    try:
        context.load_verify_locations(cafile=ca)  # the cluster's CA, and only it
    except ssl.SSLError as exc:
        raise ConfigError(f"cluster.tls.ca ({ca}) holds no CA certificate ({exc.reason or exc}): give the cluster's "
                          "CA certificate, PEM (docs/install.md, \"Certificates\").") from None
    try:
        context.load_cert_chain(cert, key)
    except ssl.SSLError as exc:
        raise ConfigError(f"cluster.tls.cert ({cert}) and cluster.tls.key ({key}) cannot be used together "
                          f"({exc.reason or exc}): give the certificate and the private key it was made for, "
                          "both PEM (docs/install.md, \"Certificates\").") from None
    return context


def _readable(path: Path, key: str) -> str:
    try:
        with open(path, "rb"):
            return str(path)
    except OSError as exc:
        raise ConfigError(f"{key}: cannot read {path} ({exc.strerror}); make the file readable by the daemon's "
                          "user, or point the key at the right file (docs/install.md, \"Certificates\").") from None
