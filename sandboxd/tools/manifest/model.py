"""What a TOOL.md declares: the ``Manifest`` and its ``Input``s, and the format's limits and keys
(the package's docstring says how a manifest is read and checked)."""

from __future__ import annotations

import enum
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, get_args

from sandboxd.tools.permissions import UNDECLARED, Permissions

MANIFEST_FILE = "TOOL.md"
MAX_MANIFEST_BYTES = 1 << 20  # a user's TOOL.md is read by the daemon: bound the work it can cause
# The frontmatter is metadata: this and yaml12's MAX_YAML_DEPTH and MAX_YAML_NODES bound a
# parse to milliseconds by construction; PARSE_TIME_LIMIT_S is the second line.
MAX_FRONTMATTER_BYTES = 64 << 10
MAX_NAME_LENGTH = 64  # model APIs refuse longer tool names
InputType = Literal["string", "number", "boolean", "enum"]
INPUT_TYPES: tuple[InputType, ...] = get_args(InputType)
LANGUAGES = ("typescript", "bash", "python")
TOP_LEVEL_KEYS = ("name", "label", "description", "version", "language", "inputs", "permissions")
INPUT_KEYS = ("type", "description", "optional", "sensitive", "values", "default")


class _NoDefault(enum.Enum):
    NO_DEFAULT = "NO_DEFAULT"

    def __repr__(self) -> str:
        return "NO_DEFAULT"


NO_DEFAULT = _NoDefault.NO_DEFAULT
"""Input.default when the manifest gives none (None is a value, not an absence)."""


@dataclass(frozen=True)
class Input:
    name: str
    type: InputType
    description: str
    optional: bool = False
    sensitive: bool = False
    values: tuple[str, ...] | None = None  # the allowed values of an enum
    default: Any = NO_DEFAULT

    @property
    def has_default(self) -> bool:
        return self.default is not NO_DEFAULT


@dataclass(frozen=True)
class Manifest:
    name: str
    label: str
    description: str
    version: int
    language: str
    inputs: tuple[Input, ...]
    body: str  # the Markdown documentation, without the frontmatter
    path: Path
    permissions: Permissions = UNDECLARED  # the permissions block (tools/permissions.py)
