"""Tools: TOOL.md manifests, their input schemas, discovery on disk and seed sync."""

from sandboxd.tools.discovery import Skipped, Tool, ToolCatalog
from sandboxd.tools.manifest import (
    NO_DEFAULT,
    Input,
    Manifest,
    parse_manifest,
    parse_manifest_text,
    read_version,
)
from sandboxd.tools.problem import Problem
from sandboxd.tools.schema import input_schema, sensitive_names, validate_arguments
from sandboxd.tools.sync import SyncAction, sync_tools

__all__ = [
    "NO_DEFAULT",
    "Input",
    "Manifest",
    "Problem",
    "Skipped",
    "SyncAction",
    "Tool",
    "ToolCatalog",
    "input_schema",
    "parse_manifest",
    "parse_manifest_text",
    "read_version",
    "sensitive_names",
    "sync_tools",
    "validate_arguments",
]
