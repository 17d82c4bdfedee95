"""What each certificate's role may call on the cluster listener (docs/security.md, "The cluster listener").

Denied unless listed: a method added to the daemon is refused over TCP until a row here names
the roles that may call it. Notifications (a cancel) are not methods: they act only on the
requests the same connection started, which its role was allowed to start.
"""

from __future__ import annotations

from types import MappingProxyType
from typing import Any, Callable, Mapping

from sandboxd.cluster.tls import Role
from sandboxd.errors import NotAllowed

NODE, ROUTER, OPERATOR = "node", "router", "operator"

# Method → the kinds of certificate that may call it.
ALLOWED: Mapping[str, frozenset[str]] = MappingProxyType({
    "ping": frozenset({NODE, ROUTER, OPERATOR}),  # every certificate the CA signed: "is it up, and do I get in"
    # A router forwards its clients' calls; the user's home host decides whether it serves them.
    "tools/call": frozenset({ROUTER}),
    "tools/list": frozenset({ROUTER}),
    "tools/watch": frozenset({ROUTER}),
    "sandbox/status": frozenset({ROUTER, OPERATOR}),
    # A user's data leaves a host only to an operator (a backup) or to the host a move sends it to.
    "users/export": frozenset({NODE, OPERATOR}),
    # A move's target pulls the user from the source (server/moves.py); the rest of a move is the operator's.
    "users/handover": frozenset({NODE}),
})
# Every other users/* method (import, move, where): the operator's alone.
_OPERATOR_PREFIX = "users/"


def may_call(role: Role, method: str) -> bool:
    kinds = ALLOWED.get(method)
    if kinds is None:
        return role.kind == OPERATOR and method.startswith(_OPERATOR_PREFIX)
    return role.kind in kinds


def refusal(role: Role, method: str) -> NotAllowed:
    """The error for ``method`` called by ``role``, naming both and who may call it."""
    kinds = sorted(ALLOWED.get(method) or ({OPERATOR} if method.startswith(_OPERATOR_PREFIX) else set()))
    who = " or ".join(f"a {kind} certificate" for kind in kinds) or "no certificate (the unix socket only)"
    return NotAllowed(f"{method} is not allowed for {role} ({role.kind} certificates may not call it over the "
                      f"cluster listener); it needs {who}, see docs/security.md, \"The cluster listener\".",
                      {"role": str(role), "method": method})


def refusing(role: Role, method: str) -> Callable[[Any, Any], Any]:
    """A method (id, params) that answers ``role``'s refusal of ``method``."""
    def refuse(_id: Any, _params: Any) -> Any:
        raise refusal(role, method)

    return refuse
