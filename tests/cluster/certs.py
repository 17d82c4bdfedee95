"""The cluster's test certificates, made with the `openssl` commands docs/install.md gives ("Certificates").

``make_certs(folder)`` makes the cluster's CA and certificates for ``node:a``, ``node:b``,
``router:r1`` and ``operator:ops``, and a foreign CA with a ``router:r1`` of its own;
``issue`` makes more (another name, an expired one). Each is a ``ClusterTLS`` a config's
``cluster.tls`` can point at (``tls_yaml``).
"""

from __future__ import annotations

import subprocess
from dataclasses import dataclass
from pathlib import Path

# What a leaf certificate may do: both ends of a TLS connection (a node serves, and dials another).
LEAF_EXTENSIONS = """basicConstraints=CA:FALSE
keyUsage=critical,digitalSignature
extendedKeyUsage=serverAuth,clientAuth
"""
EC_KEY = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes"]


@dataclass(frozen=True)
class Cert:
    cert: Path
    key: Path
    ca: Path  # the CA the holder trusts (its cluster's)

    def tls_yaml(self, indent: str = "  ") -> str:
        """The ``tls:`` block of a ``cluster:`` section for this holder."""
        return (f"{indent}tls:\n{indent}  cert: {self.cert}\n{indent}  key: {self.key}\n"
                f"{indent}  ca: {self.ca}\n")


@dataclass(frozen=True)
class CA:
    folder: Path
    name: str

    @property
    def cert(self) -> Path:
        return self.folder / f"{self.name}.pem"

    @property
    def key(self) -> Path:
        return self.folder / f"{self.name}.key"

    def issue(self, common_name: str, *, days: int = 825, file_name: str | None = None) -> Cert:
        """A certificate for ``common_name`` signed by this CA; ``days=-1`` makes one that expired yesterday."""
        stem = self.folder / (file_name or f"{self.name}-{common_name.replace(':', '-')}")
        key, csr, pem = stem.with_suffix(".key"), stem.with_suffix(".csr"), stem.with_suffix(".pem")
        extensions = self.folder / "leaf.cnf"
        extensions.write_text(LEAF_EXTENSIONS)
        _openssl("req", "-new", *EC_KEY, "-keyout", key, "-out", csr, "-subj", f"/CN={common_name}")
        _openssl("x509", "-req", "-in", csr, "-CA", self.cert, "-CAkey", self.key, "-CAcreateserial",
                 "-days", str(days), "-out", pem, "-extfile", extensions)
        csr.unlink()
        return Cert(pem, key, self.cert)


def make_ca(folder: Path, name: str = "ca", subject: str = "sandboxd cluster CA") -> CA:
    folder.mkdir(parents=True, exist_ok=True)
    ca = CA(folder, name)
    _openssl("req", "-x509", *EC_KEY, "-keyout", ca.key, "-out", ca.cert, "-days", "3650", "-subj", f"/CN={subject}",
             "-addext", "basicConstraints=critical,CA:TRUE", "-addext", "keyUsage=critical,keyCertSign,cRLSign")
    return ca


@dataclass(frozen=True)
class ClusterCerts:
    ca: CA
    node_a: Cert
    node_b: Cert
    router: Cert  # router:r1
    operator: Cert  # operator:ops
    foreign_ca: CA
    foreign_router: Cert  # router:r1, signed by the foreign CA, trusting the cluster's CA (so only the server refuses)


def make_certs(folder: Path) -> ClusterCerts:
    """The cluster's CA and its certificates, and a foreign CA's, in ``folder`` (about 0.3 s)."""
    ca, foreign = make_ca(folder), make_ca(folder, "foreign-ca", "another CA")
    stray = foreign.issue("router:r1")
    return ClusterCerts(ca, ca.issue("node:a"), ca.issue("node:b"), ca.issue("router:r1"), ca.issue("operator:ops"),
                        foreign, Cert(stray.cert, stray.key, ca.cert))


def _openssl(*args: object) -> None:
    done = subprocess.run(["openssl", *map(str, args)], capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"openssl {' '.join(map(str, args))} failed:\n{done.stderr}")
