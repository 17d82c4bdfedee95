"""What one call was granted beyond the sandbox's standing policy, and the end of it with the call.

A call may open the browser relay's port (integrations.browser_relay) and have its secrets'
values put into requests (egress.secrets). Both are the call's, not the sandbox's: a warm
sandbox runs other calls later, and a socket a tool left open must not carry the grant into
them. The sandbox makes a ``CallGrant`` for each call (sandbox/shim.py) and ends it when the
call is answered; the egress proxy holds each connection admitted under it (egress/proxy.py),
and ending the grant ends those connections at once.
"""

from __future__ import annotations

import asyncio

GRANT_ENDED = "the call that granted it has been answered"


class CallGrant:
    """One call's grant: the proxy's connections admitted under it, all ended by ``end``."""

    __slots__ = ("_held", "ended")

    def __init__(self) -> None:
        # Made by the first connection: every Docker call has a grant, few open a connection under it.
        self._held: set[asyncio.Task[None]] | None = None
        self.ended = False

    def __repr__(self) -> str:
        return f"<CallGrant {'ended' if self.ended else 'running'} connections={len(self._held or ())}>"

    def hold(self, connection: asyncio.Task[None]) -> bool:
        """Tie ``connection`` (the task serving it) to the call; False when the call has been answered."""
        if self.ended:
            return False
        if self._held is None:
            self._held = set()
        self._held.add(connection)
        return True

    def release(self, connection: asyncio.Task[None]) -> None:
        if self._held is not None:
            self._held.discard(connection)

    def end(self) -> None:
        """The call is answered: every connection held under it ends now (its task is cancelled)."""
        self.ended = True
        held, self._held = self._held, None
        for connection in held or ():
            connection.cancel()
