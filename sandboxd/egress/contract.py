"""What a sandbox backend and the egress proxy agree on: the proxy serves each sandbox's egress
socket (``Egress``, ``EgressSession``) and asks the sandbox what it is doing now (``EgressContext``).

Here, in egress/, so the proxy needs nothing of sandbox/: the backends implement and call this.
"""

from __future__ import annotations

import socket
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Protocol

if TYPE_CHECKING:
    from sandboxd.egress.grants import CallGrant
    from sandboxd.rules.secrets import StandIns
    from sandboxd.rules.tool_network import ToolNetwork
    from sandboxd.service.peercred import PeerCredentials


@dataclass(frozen=True)
class EgressCall:
    """What a sandbox is doing, for its egress: the running tool (None when idle), the secrets its
    output is masked against, the running call's stand-ins (egress.secrets) and the browser relay
    port it was granted (integrations.browser_relay; None when not); ``grant`` ends the egress connections
    admitted by these when the call is answered (egress/grants.py; None when idle); ``network`` is the
    running tool's permissions.network (rules/tool_network.py; None: the policy alone decides)."""

    tool: str | None
    secrets: frozenset[str]
    stand_ins: StandIns
    relay_port: int | None = None
    grant: CallGrant | None = None
    network: ToolNetwork | None = None


EgressContext = Callable[[], EgressCall]


class EgressSession(Protocol):
    """One sandbox's way out (egress/proxy.py): it serves the sandbox's egress socket."""

    async def serve(self, listener: socket.socket, is_sandbox: Callable[[PeerCredentials], bool]) -> None:
        """Accept and serve the connections made to ``listener`` by the sandbox (``is_sandbox``) until cancelled."""
        ...

    def close(self) -> None:
        """End every connection: the sandbox is gone."""
        ...


class Egress(Protocol):
    def session(self, user: str, sandbox_id: str, context: EgressContext) -> EgressSession: ...
