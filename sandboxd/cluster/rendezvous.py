"""Where a user with no home goes: rendezvous hashing (highest random weight) over the active hosts.

Every router computes the same answer from the same host names, with no shared state, and
adding or removing a host moves only the users whose highest weight it held (about 1/N).
"""

from __future__ import annotations

import hashlib
from typing import Iterable


def weight(user: str, node: str) -> int:
    """The pair's weight: a stable 64-bit hash (not Python's hash(), which each process salts)."""
    digest = hashlib.blake2b(f"{node}\0{user}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big")


def place(user: str, nodes: Iterable[str]) -> str | None:
    """The node of highest weight for ``user`` (ties by name), or None when there is none."""
    return max(nodes, key=lambda node: (weight(user, node), node), default=None)
