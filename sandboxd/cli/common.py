"""What every `sandboxd` command shares: exit codes, the common flags, errors on stderr, tool arguments and results.

Exit codes: 0 ok, 1 failure (a tool error, a validation error), 2 usage or
daemon error. Results go to stdout, diagnostics to stderr.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any, Callable

from sandboxd.config import Config
from sandboxd.errors import InvalidParams
from sandboxd.users import check_user

EXIT_OK, EXIT_FAILURE, EXIT_USAGE = 0, 1, 2

Handler = Callable[[argparse.Namespace, Config], int]


def common_parent() -> argparse.ArgumentParser:
    """Flags every command takes: where the config and the data are."""
    parent = argparse.ArgumentParser(add_help=False)
    parent.add_argument("--config", type=Path, metavar="FILE",
                        help="YAML config file (default: $SANDBOXD_CONFIG, then /etc/sandboxd/config.yaml if present)")
    parent.add_argument("--data-path", type=Path, metavar="DIR", help="root of tools and user data (DATA_PATH)")
    return parent


def config_overrides(args: argparse.Namespace) -> dict[str, Any]:
    """Flags that map onto config keys; absent flags (None) leave the config alone."""
    return {
        "data_path": getattr(args, "data_path", None),
        "socket": getattr(args, "socket", None),
        "seed_tools": getattr(args, "seed_tools", None),
        "backend": getattr(args, "backend", None),
        "log_level": getattr(args, "log_level", None),
    }


def fail(message: str, code: int = EXIT_FAILURE) -> int:
    print(f"sandboxd: {message}", file=sys.stderr)
    return code


def user_argument(text: str) -> str:
    try:
        return check_user(text)
    except InvalidParams as exc:
        raise argparse.ArgumentTypeError(exc.message) from None


def add_argument_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--arg", action="append", default=[], metavar="KEY=VALUE",
                   help="a tool argument (repeatable); values are coerced by the tool's schema")
    p.add_argument("--json", dest="json_args", metavar="OBJECT", help="tool arguments as a JSON object")


def parse_tool_arguments(args: argparse.Namespace) -> dict[str, Any]:
    """--json first, then each --arg on top. Raises ValueError with a usage message."""
    arguments: dict[str, Any] = {}
    if args.json_args:
        try:
            loaded = json.loads(args.json_args)
        except ValueError as exc:
            raise ValueError(f"--json is not valid JSON: {exc}") from None
        if not isinstance(loaded, dict):
            raise ValueError("--json must be a JSON object like '{\"name\": \"World\"}'")
        arguments.update(loaded)
    for item in args.arg:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ValueError(f"--arg {item!r} must look like KEY=VALUE")
        arguments[key] = value
    return arguments


def print_progress(params: dict[str, Any]) -> None:
    for block in params.get("content") or []:
        if isinstance(block, dict) and block.get("type") == "text":
            print(f"… {block.get('text', '')}", file=sys.stderr, flush=True)


def print_result(result: dict[str, Any]) -> None:
    for block in result.get("content") or []:
        if isinstance(block, dict) and block.get("type") == "text":
            print(block.get("text", ""))
        elif isinstance(block, dict):
            print(f"[{block.get('type')} block, {block.get('mimeType', '')}]")
    if result.get("status") != "ok":
        print(f"sandboxd: the call ended with status {result.get('status')} after {result.get('durationMs')} ms",
              file=sys.stderr)
