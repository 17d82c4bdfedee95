"""The daemon's error tree.

Everything that can go wrong below the server is one of these; the server maps
them to JSON-RPC codes at the edge (``code``), so no other layer knows about
the wire protocol. ``message`` is one sentence a person can act on.
"""

from __future__ import annotations

from typing import Any


class SandboxdError(Exception):
    code = -32603  # internal error

    def __init__(self, message: str, data: Any = None) -> None:
        super().__init__(message)
        self.message = message
        self.data = data


class ConfigError(SandboxdError):
    """The configuration cannot be used; start-up stops."""


class InvalidParams(SandboxdError):
    """Bad params: unknown tool, arguments that fail the schema, bad user, forbidden env."""

    code = -32602


class MethodNotFound(SandboxdError):
    """A request for a method the daemon does not have."""

    code = -32601


class Overloaded(SandboxdError):
    """No sandbox could be had within the queue deadline."""

    code = -32001


class BackendUnavailable(SandboxdError):
    """The sandbox backend (Docker) cannot be reached or refused to start a sandbox."""

    code = -32002


class QuotaExceeded(SandboxdError):
    """The user's folders hold more than their quota (storage.*); their calls are refused until they hold less."""

    code = -32004


class NotServedHere(SandboxdError):
    """The cluster's directory says this host may not serve the user now (docs/protocol.md, "Not served here"):
    ``data.reason`` is ``elsewhere``, ``moving``, ``node_down`` or ``fenced``, with what a client needs to go on."""

    code = -32005

    def __init__(self, reason: str, message: str, **data: Any) -> None:
        super().__init__(message, {"reason": reason, **data})
        self.reason = reason


class NotAllowed(SandboxdError):
    """A method the peer's certificate may not call over the cluster listener (cluster/roles.py); ``data`` names
    the ``role`` and the ``method``."""

    code = -32006


class UnsafeMount(BackendUnavailable):
    """A path sandboxd would mount into a sandbox is a link or not what it should be; the sandbox is not started."""


class SandboxFailed(SandboxdError):
    """A sandbox died or broke the shim protocol; the call is answered as ``crashed`` (``message`` says why)."""


class ShuttingDown(SandboxdError):
    """The daemon is stopping and takes no new calls."""

    code = -32002

    def __init__(self) -> None:
        super().__init__("sandboxd is shutting down and takes no new calls; retry once it is back.")


class PeerRefused(SandboxdError):
    """The process on the other end of a connection is not allowed by allowed_uids/allowed_gids."""

    code = -32003
