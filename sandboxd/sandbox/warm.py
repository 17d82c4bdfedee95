"""Which sandboxes case 7 of ``Pool._plan`` keeps warm: min_idle counts an account's idle
sandboxes of every email access together, and a spare carries the access its user used last.

Last, not most: a session's listing warms the access most of its tools need (email_access.py,
``likely_owner``) and counts as a use, and a user who moved on to tools of another access is
best served by a spare of that one. The owner they left goes quiet and its sandboxes expire.
"""

from __future__ import annotations

from collections import Counter
from typing import Iterable, Mapping, Sequence

from sandboxd.sandbox.email_access import owner_user
from sandboxd.sandbox.pooled import PooledSandbox


def used_last(owners: Iterable[str], last_call: Mapping[str, float]) -> dict[str, str]:
    """Each account's owner among ``owners`` called or warmed last (by ``last_call``; a tie: the first)."""
    last: dict[str, str] = {}
    for owner in owners:
        account = owner_user(owner)
        if account not in last or last_call.get(owner, 0.0) > last_call.get(last[account], 0.0):
            last[account] = owner
    return last


def idle_by_account(idle_of: Mapping[str, Sequence[PooledSandbox]]) -> Counter[str]:
    """How many idle sandboxes each account keeps, of every access (``idle_of``: by owner)."""
    idle = Counter[str]()
    for owner, mine in idle_of.items():
        idle[owner_user(owner)] += len(mine)
    return idle
