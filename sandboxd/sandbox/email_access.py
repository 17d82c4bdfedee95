"""Which access to the email database a sandbox carries, fixed from its start to its end.

A tool runs in the shim's own process, so whatever one call was given stays in reach of the
next: a descriptor a timer keeps, SQLite's mapped ``-shm``, a connection cached in a module.
Nothing inside a sandbox can take a grant back. So a sandbox is started with one access
(``none``: no /officer/data at all; ``read``: the folder mounted read-only; ``write``: read-write)
and serves only calls of tools with that access (docs/design.md, "The email database, per call").

The pool knows sandboxes by owner: the user for ``write`` (today's sandboxes, and every tool
without a permissions block), the user and the access for the other two. Each owner is its
own entry in the pool, so a ``none`` call is never handed a sandbox that mounts the database.
"""

from __future__ import annotations

from collections import Counter
from typing import Iterable, get_args

from sandboxd.tools.permissions import OWNER_MARK, EmailAccess, Permissions, owner_suffix

FULL_ACCESS: EmailAccess = "write"  # what a sandbox had before permissions, and what an undeclared tool keeps
_ACCESS = frozenset(get_args(EmailAccess))


def owner(user: str, access: EmailAccess) -> str:
    """The pool's owner of a sandbox of ``user`` carrying ``access``."""
    return user + owner_suffix(access)


def call_owner(user: str, permissions: Permissions, required: bool) -> str:
    """The owner whose sandbox may run a call of a tool with ``permissions``
    (``required``: tools.require_permissions). A call itself adds its tool's ToolAccess.owner_suffix."""
    return user + owner_suffix(permissions.email_access(required))


def likely_owner(user: str, permissions: Iterable[Permissions], required: bool) -> str:
    """The owner most of ``user``'s tools (their ``permissions``) run in: what a session's listing warms."""
    owners = Counter(call_owner(user, each, required) for each in permissions)
    return owners.most_common(1)[0][0] if owners else user


def owner_user(key: str) -> str:
    """The user an owner belongs to."""
    return key.partition(OWNER_MARK)[0]  # once per call (Pool.acquire): partition makes no list, split does


def owner_access(key: str) -> EmailAccess:
    """The access an owner's sandboxes carry."""
    access = key.partition(OWNER_MARK)[2]
    if not access:
        return FULL_ACCESS
    if access not in _ACCESS:
        raise ValueError(f"{key!r} names no email access of {sorted(_ACCESS)}")
    return access  # type: ignore[return-value]  # checked against the Literal's values
