"""TOOL.md parsing: YAML frontmatter between ``---`` lines, then a Markdown body.

Nothing here raises for bad content. Every finding becomes a ``Problem`` that
names the file, the line, the field and the fix, and all of them are reported
at once, so an author fixes a manifest in one pass. A manifest with any error
is not returned: half-understood tools are never offered to an agent.

The YAML is read with the YAML 1.2 core schema, as the JavaScript loaders of
pi read it (yaml12.py). A user's TOOL.md is written by that user's sandboxes, so
it is hostile input the daemon parses: the loader refuses anchors and aliases and
bounds depth, nodes and time; the frontmatter is bounded in bytes here.
"""

from sandboxd.tools.manifest.checker import parse_manifest, parse_manifest_text, suggest_snake_case
from sandboxd.tools.manifest.model import (
    INPUT_KEYS,
    INPUT_TYPES,
    LANGUAGES,
    MANIFEST_FILE,
    MAX_FRONTMATTER_BYTES,
    MAX_MANIFEST_BYTES,
    MAX_NAME_LENGTH,
    NO_DEFAULT,
    TOP_LEVEL_KEYS,
    Input,
    InputType,
    Manifest,
)
from sandboxd.tools.manifest.source import read_version
from sandboxd.tools.problem import Problem

__all__ = [
    "INPUT_KEYS",
    "INPUT_TYPES",
    "LANGUAGES",
    "MANIFEST_FILE",
    "MAX_FRONTMATTER_BYTES",
    "MAX_MANIFEST_BYTES",
    "MAX_NAME_LENGTH",
    "NO_DEFAULT",
    "TOP_LEVEL_KEYS",
    "Input",
    "InputType",
    "Manifest",
    "Problem",
    "parse_manifest",
    "parse_manifest_text",
    "read_version",
    "suggest_snake_case",
]
