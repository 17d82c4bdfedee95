"""`sandboxd` command line: ordinary conventions (cli/common.py), one module of commands per topic.

Exit codes: 0 ok, 1 failure (a tool error, a validation error), 2 usage or
daemon error. Results go to stdout, diagnostics to stderr.
"""

from __future__ import annotations

import argparse
import sys

from sandboxd import __version__
from sandboxd.cli import (client_cmds, cluster_cmds, dev_cmds, mcp_cmds, router_cmds, serve_cmds, storage_cmds,
                          tools_cmds, users_cmds)
from sandboxd.cli.common import EXIT_OK, EXIT_USAGE, Handler, common_parent, config_overrides, fail
from sandboxd.config import RUNNER_IMAGE, load_config
from sandboxd.errors import ConfigError


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="sandboxd",
        description="Run AI agents' tools in warm, hardened Node.js sandboxes.",
    )
    parser.add_argument("--version", action="version", version=f"sandboxd {__version__} (runner image {RUNNER_IMAGE})")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    parent = common_parent()
    # users_cmds after cluster_cmds: it adds export and import to the `users` command cluster_cmds makes.
    for module in (serve_cmds, client_cmds, mcp_cmds, router_cmds, tools_cmds, dev_cmds, storage_cmds, cluster_cmds,
                   users_cmds):
        module.add_commands(subparsers, parent)
    return parser


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
