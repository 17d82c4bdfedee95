"""Where one tool's call may connect: its TOOL.md's ``permissions.network``, inside the operator's policy.

The egress proxy asks this before the policy (egress/session.py): a destination the tool did
not declare is refused whatever the policy says, naming the tool and the entry it lacks. What
the tool declared still goes through the policy, so the call's grant is the intersection of
both. Entries are written as ``egress.allow`` writes them; ``*`` leaves the policy alone.
"""

from __future__ import annotations

from dataclasses import dataclass

from sandboxd.rules.policy import AllowEntry
from sandboxd.rules.secrets import names_host

ANY_HOST = "*"  # a network entry that hands every destination to the operator's policy


@dataclass(frozen=True)
class ToolNetwork:
    """One tool's ``permissions.network``: its entries, or ``any_host`` for ``*``."""

    tool: str
    entries: tuple[AllowEntry, ...] = ()
    any_host: bool = False

    def grant(self, host: str, port: int, ports: frozenset[int]) -> str | None:
        """The entry that lets the call reach ``host:port`` (lower case), or None when none does."""
        if self.any_host:
            return ANY_HOST
        for entry in self.entries:
            if names_host((entry,), host, port, ports):
                return entry.text
        return None

    def refusal(self, host: str, port: int, ports: frozenset[int]) -> str:
        """The 403's line: the tool, the entry it lacks (with the port when egress.ports lacks it), and who adds it."""
        declared = ", ".join(entry.text for entry in self.entries) or "nothing"
        missing = host if port in ports else f"{host}:{port}"
        return (f"egress to {host}:{port} refused by sandboxd: tool {self.tool!r} does not declare {missing} in "
                f"permissions.network (it declares {declared}); the tool's author adds '{missing}' to "
                "permissions.network in its TOOL.md")

    def decided(self, host: str, port: int, ports: frozenset[int]) -> str:
        """What the log's egress line says decided for the tool: the entry that let it through, or none."""
        entry = self.grant(host, port, ports)
        if entry is None:
            return f"permissions.network of {self.tool} names no entry for {host}:{port}"
        return f"permissions.network entry {entry} of {self.tool}"
