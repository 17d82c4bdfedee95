"""A tool as the daemon knows it: its parsed TOOL.md, its folder and entry file, and where it came from."""

from __future__ import annotations

import copy
import json
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any, Literal

from sandboxd.tools.manifest import Manifest
from sandboxd.tools.permissions import Permissions, ToolAccess
from sandboxd.tools.problem import Problem
from sandboxd.tools.schema import ArgumentsCheck, input_schema, sensitive_names

ENTRY_FILES = ("index.ts", "index.js")  # in order of preference
Source = Literal["global", "user"]


@dataclass(frozen=True)
class Tool:
    manifest: Manifest
    dir: Path
    entry: Path
    source: Source

    @cached_property  # read a few times per call: once cached, a plain attribute
    def name(self) -> str:
        return self.manifest.name

    @cached_property
    def permissions(self) -> Permissions:
        """Its TOOL.md's permissions block (tools/permissions.py); ``declared`` False without one."""
        return self.manifest.permissions

    @cached_property
    def accesses(self) -> tuple[ToolAccess, ToolAccess]:
        """What each of its calls gets, without and with tools.require_permissions (indexed by it): worked
        out once per tool, as a reload may turn the key on or off."""
        permissions, name = self.manifest.permissions, self.name
        return permissions.access_for(name, False), permissions.access_for(name, True)

    @cached_property
    def schema(self) -> dict[str, Any]:
        """The inputSchema; shared, so treat it as read-only (to_protocol hands out copies)."""
        return input_schema(self.manifest)

    @cached_property
    def check_arguments(self) -> ArgumentsCheck:
        """A call's arguments checked and coerced against the inputSchema (schema.validate_arguments)."""
        return ArgumentsCheck(self.schema, self.name)

    @cached_property
    def sensitive(self) -> frozenset[str]:
        """The names of its sensitive (writeOnly) inputs: masked in logs, never shown in errors."""
        return frozenset(sensitive_names(self.schema))

    @cached_property
    def protocol_bytes(self) -> int:
        """The size of this tool's Tool object in a tools/list answer."""
        return len(json.dumps(self.to_protocol(), ensure_ascii=False).encode())

    def to_protocol(self) -> dict[str, Any]:
        """The Tool object of docs/protocol.md's tools/list, keys in the spec's order."""
        manifest = self.manifest
        return {
            "name": manifest.name,
            "label": manifest.label,
            "description": manifest.description,
            "version": manifest.version,
            "language": manifest.language,
            "source": self.source,
            "inputSchema": copy.deepcopy(self.schema),
            "documentation": manifest.body,
            "permissions": manifest.permissions.to_protocol(),
        }


@dataclass(frozen=True)
class Skipped:
    """A directory that is not a usable tool, and why."""

    dir: Path
    source: Source
    problems: list[Problem]
