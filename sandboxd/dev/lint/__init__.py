"""`sandboxd validate`: the tool developer's linter.

validation.py walks the tools at a path (manifest, entry code, forgotten version bumps);
entry.py runs the common-mistakes checks on an entry file, finding execute with exports.py
and judging its returns with returns.py, over syntax.py's tree-sitter view of the source;
synced.py compares a tool with its synced copy.
"""

from sandboxd.dev.lint.entry import check_entry_file, check_entry_source
from sandboxd.dev.lint.synced import check_synced_copy
from sandboxd.dev.lint.syntax import EXECUTE_SIGNATURE, EXPORT_FIX, RETURN_FIX
from sandboxd.dev.lint.validation import validate_paths, validate_tool_dir

__all__ = [
    "EXECUTE_SIGNATURE",
    "EXPORT_FIX",
    "RETURN_FIX",
    "check_entry_file",
    "check_entry_source",
    "check_synced_copy",
    "validate_paths",
    "validate_tool_dir",
]
