"""The ``cluster:`` section: this host's place among several (docs/scale.md).

Without the section the daemon is a standalone host, as before, and needs no etcd. With it,
the daemon registers itself in etcd, serves only the users whose record names it, and listens
for other hosts, routers and operators on a mutual-TLS port.
"""

from __future__ import annotations

import re
from pathlib import Path

from pydantic import Field, field_validator, model_validator

from sandboxd.config.sections import Section
from sandboxd.hostport import parse_host_port

# A node's name is a key segment in etcd and part of a certificate's common name (node:NAME).
NODE_NAME = re.compile(r"[a-z0-9][a-z0-9.-]{0,62}")


class ClusterTLS(Section):
    cert: Path = Field(description="This host's (or operator's, router's) certificate, PEM.")
    key: Path = Field(description="The private key of cert, PEM.")
    ca: Path = Field(description="The cluster's CA certificate, PEM: only certificates it signed are let in, and dialled.")


class ClusterConfig(Section):
    node: str | None = Field(None, description="This host's name in the directory (lowercase letters, digits, '.', '-'); the operator's and router's commands leave it out.")
    etcd: list[str] = Field(description="etcd client endpoints, e.g. ['http://10.0.0.5:2379'].", min_length=1)
    prefix: str = Field("/sandboxd/", description="Key prefix of the directory in etcd: several clusters may share one etcd.")
    lease_s: int = Field(5, ge=2, le=60, description="Life of this host's lease; a host that cannot renew it for this long stops starting calls (fenced).")
    listen: str | None = Field(None, description="HOST:PORT of the mutual-TLS listener (e.g. '0.0.0.0:7443'); null = none.")
    advertise: str | None = Field(None, description="HOST:PORT other hosts and routers dial to reach this one (default: listen).")
    tls: ClusterTLS = Field(description="Certificates of the mutual-TLS listener and of every connection to another host.")
    keep_moved_s: int = Field(86_400, ge=0, description="How long a host keeps a moved user's copy, read-only, before removing it.")

    @field_validator("node")
    @classmethod
    def _node_name(cls, value: str | None) -> str | None:
        if value is not None and not NODE_NAME.fullmatch(value):
            raise ValueError(f"{value!r} is not a node name: use lowercase letters, digits, '.' and '-' (at most 63)")
        return value

    @field_validator("listen")
    @classmethod
    def _listen(cls, value: str | None) -> str | None:
        if value is not None:
            parse_host_port(value, example="'0.0.0.0:7443'", lowest_port=1)
        return value

    @field_validator("advertise")
    @classmethod
    def _advertise(cls, value: str | None) -> str | None:
        # A name is allowed here (a Swarm service's DNS name): it is dialled, never bound.
        host, sep, port = (value or "x:1").rpartition(":")
        if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ValueError(f"{value!r} is not HOST:PORT; e.g. 'node1.example:7443' or '10.0.0.5:7443'")
        return value

    @field_validator("prefix")
    @classmethod
    def _prefix(cls, value: str) -> str:
        if not value.startswith("/") or not value.endswith("/"):
            raise ValueError(f"{value!r}: the prefix starts and ends with '/', e.g. '/sandboxd/'")
        return value

    @model_validator(mode="after")
    def _dialable(self) -> "ClusterConfig":
        if self.listen is not None and self.advertise is None and self.listen.rpartition(":")[0] in ("0.0.0.0", "[::]"):
            raise ValueError("cluster.listen binds every address: set cluster.advertise to the address other hosts dial")
        return self

    def dial_address(self) -> str | None:
        """What other hosts dial to reach this one: advertise, else listen."""
        return self.advertise or self.listen
