"""`sandboxd` command line: ordinary conventions.

Exit codes: 0 ok, 1 failure (a tool error, a validation error), 2 usage or
daemon error. Results go to stdout, diagnostics to stderr.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any, Callable

from sandboxd import __version__
from sandboxd.config import RUNNER_IMAGE, Config, load_config
from sandboxd.errors import ConfigError

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


def build_parser() -> argparse.ArgumentParser:
    from sandboxd.cli import client_cmds, dev_cmds, mcp_cmds, serve_cmds, tools_cmds

    parser = argparse.ArgumentParser(
        prog="sandboxd",
        description="Run AI agents' tools in warm, hardened Node.js sandboxes.",
    )
    parser.add_argument("--version", action="version", version=f"sandboxd {__version__} (runner image {RUNNER_IMAGE})")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    parent = common_parent()
    for module in (serve_cmds, client_cmds, mcp_cmds, tools_cmds, dev_cmds):
        module.add_commands(subparsers, parent)
    return parser


def fail(message: str, code: int = EXIT_FAILURE) -> int:
    print(f"sandboxd: {message}", file=sys.stderr)
    return code


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        config = load_config(args.config, overrides=config_overrides(args))
    except ConfigError as exc:
        return fail(exc.message, EXIT_USAGE)
    handler: Handler = args.handler
    try:
        return handler(args, config)
    except ConfigError as exc:
        return fail(exc.message, EXIT_USAGE)
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        return EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
