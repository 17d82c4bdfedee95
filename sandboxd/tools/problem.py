"""A finding about a tool (its manifest, its files, its checks): what is wrong, where, and the fix."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

Severity = Literal["error", "warning"]


@dataclass(frozen=True)
class Problem:
    """One finding about a tool: what is wrong, where, and how to fix it."""

    path: Path
    message: str
    fix: str
    field: str | None = None
    line: int | None = None
    severity: Severity = "error"

    @property
    def is_error(self) -> bool:
        return self.severity == "error"

    def __str__(self) -> str:
        parts = [f"{self.path}:{self.line}" if self.line else str(self.path), self.severity]
        if self.field:
            parts.append(self.field)
        parts.append(f"{self.message.rstrip('.')}. Fix: {self.fix.rstrip('.')}")
        return ": ".join(parts)

    def to_dict(self) -> dict[str, Any]:
        return {"path": str(self.path), "line": self.line, "field": self.field,
                "severity": self.severity, "message": self.message, "fix": self.fix}
