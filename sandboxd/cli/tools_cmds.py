"""`sandboxd tools list|show`, `sandboxd sync` and `sandboxd validate`.

``tools list`` and ``tools show`` ask the running daemon when one answers at the
configured socket (what an agent really sees), and read the disk otherwise.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from sandboxd.cli.common import EXIT_FAILURE, EXIT_OK, fail, user_argument
from sandboxd.client import Client, DaemonUnreachable, RpcError
from sandboxd.config import Config
from sandboxd.tools.discovery import Skipped, ToolCatalog
from sandboxd.tools.sync import sync_tools
from sandboxd.dev.lint.validation import validate_paths
from sandboxd.users import global_tools_dir, user_tools_dir

DAEMON_TIMEOUT_S = 10.0  # a daemon that does not answer tools/list by then is treated as absent


def add_commands(subparsers: Any, parent: argparse.ArgumentParser) -> None:
    # The common flags go on the leaf commands only: argparse lets a subcommand's defaults
    # overwrite flags given to its parent command ("tools --data-path D list" would lose D).
    tools = subparsers.add_parser("tools", help="list and inspect tools", description="List and inspect tools.")
    tools_commands = tools.add_subparsers(dest="tools_command", metavar="COMMAND", required=True)

    listing = tools_commands.add_parser(
        "list", parents=[parent], help="list the tools a user can call",
        description="List the global tools, and with --user the user's own (which override global ones).")
    listing.add_argument("--user", type=user_argument, metavar="U", help="include this user's tools (an email address)")
    listing.add_argument("--all", action="store_true", help="also list directories that are skipped, and why")
    listing.add_argument("--json", action="store_true", help="print the tools/list result of docs/protocol.md")
    _add_source_flags(listing)
    listing.set_defaults(handler=list_tools)

    show = tools_commands.add_parser(
        "show", parents=[parent], help="show one tool's schema and documentation",
        description="Show a tool's metadata, inputSchema and documentation.")
    show.add_argument("name", metavar="NAME", help="the tool's name")
    show.add_argument("--user", type=user_argument, metavar="U", help="look among this user's tools too")
    show.add_argument("--json", action="store_true", help="print the tool as a tools/list Tool object")
    _add_source_flags(show)
    show.set_defaults(handler=show_tool)

    sync = subparsers.add_parser(
        "sync", parents=[parent], help="install or update the seed tools in DATA_PATH/tools",
        description="Copy each seed tool into DATA_PATH/tools when its version is higher than the installed one.")
    sync.add_argument("--seed-tools", dest="seed_tools", type=Path, default=None, metavar="DIR",
                      help="directory of seed tools (default: the config's seed_tools)")
    sync.set_defaults(handler=sync_command)

    validate = subparsers.add_parser(
        "validate", parents=[parent], help="check tools for problems",
        description="Check tool directories, TOOL.md files or directories of tools: the manifest, the entry "
                    "file's code (the common mistakes of docs/tool-development.md) and, for tools that are "
                    "synced, whether the copy in DATA_PATH/tools needs a version bump. Exit 1 on any error.")
    validate.add_argument("paths", nargs="+", type=Path, metavar="PATH",
                          help="a tool directory, a TOOL.md, or a directory of tools")
    validate.add_argument("--json", action="store_true", help='print {"problems": [...], "errors": N, "warnings": N}')
    validate.set_defaults(handler=validate_command)


def _add_source_flags(command: argparse.ArgumentParser) -> None:
    command.add_argument("--socket", type=Path, metavar="PATH",
                         help="ask the daemon on this socket (default: the config's socket)")
    command.add_argument("--disk", action="store_true",
                         help="read DATA_PATH instead of asking a running daemon (also implied by --data-path)")


def _print_json(value: Any) -> None:
    print(json.dumps(value, indent=2, ensure_ascii=False))


# --- tools list / show -------------------------------------------------------------------------


class _DaemonFailed(Exception):
    """The daemon answered with an error: say it, do not fall back to a disk it may not read."""


def _from_daemon(args: argparse.Namespace, config: Config) -> list[dict[str, Any]] | None:
    """The daemon's tools/list answer, or None (after saying why) when the disk is to be read."""
    if args.disk or (args.data_path is not None and args.socket is None):
        _note(f"reading the tools from the disk in {config.data_path}")
        return None
    params = {"user": args.user} if args.user is not None else {}
    try:
        with Client(config.socket, timeout=DAEMON_TIMEOUT_S) as client:
            result = client.request("tools/list", params)
    except RpcError as exc:
        raise _DaemonFailed(f"the daemon at {config.socket} refused tools/list: {exc.message}") from None
    except (DaemonUnreachable, OSError) as exc:  # not running, not ours, or not answering in time
        why = str(exc) if isinstance(exc, DaemonUnreachable) else f"{type(exc).__name__}: {exc}"
        _note(f"no daemon answers at {config.socket} ({why.rstrip('.')}); reading the tools from the disk in "
              f"{config.data_path}")
        return None
    _note(f"tools as the daemon at {config.socket} serves them (--disk reads {config.data_path} instead)")
    return list(result.get("tools", []))


def _note(message: str) -> None:
    print(f"sandboxd: {message}", file=sys.stderr, flush=True)


def list_tools(args: argparse.Namespace, config: Config) -> int:
    if args.all and not args.disk:
        args.disk = True  # skipped directories are known on the disk only
    try:
        served = _from_daemon(args, config)
    except _DaemonFailed as exc:
        return fail(str(exc))
    skipped: list[Skipped] = []
    if served is None:
        tools, skipped = ToolCatalog(config.data_path).scan(args.user)
        served = [tool.to_protocol() for tool in tools]
    if args.json:
        result: dict[str, Any] = {"tools": served}
        if args.all:
            result["skipped"] = [_skipped_dict(entry) for entry in skipped]
        _print_json(result)
        return EXIT_OK
    if served:
        _print_table(served)
    elif args.disk or args.data_path is not None:
        print(f"no tools in {_roots(config, args.user)}; `sandboxd sync` installs the seed tools")
    else:
        print("the daemon serves no tools; `sandboxd sync` installs the seed tools")
    if args.all:
        for entry in skipped:
            print(f"\nskipped {entry.dir} ({entry.source}):")
            for problem in entry.problems:
                print(f"  {problem}")
    return EXIT_OK


def _roots(config: Config, user: str | None) -> str:
    roots = [global_tools_dir(config.data_path)]
    if user is not None:
        roots.append(user_tools_dir(config.data_path, user))
    return " or ".join(str(root) for root in roots)


def _print_table(tools: list[dict[str, Any]]) -> None:
    rows = [("NAME", "VERSION", "SOURCE", "PERMISSIONS", "DESCRIPTION")]
    rows += [(t["name"], str(t["version"]), t["source"], permissions_summary(t.get("permissions")),
              (t["description"].splitlines() or [""])[0]) for t in tools]
    widths = [max(len(row[column]) for row in rows) for column in range(4)]
    for row in rows:
        print("  ".join(cell.ljust(width) for cell, width in zip(row, widths)) + "  " + row[4])


def permissions_summary(permissions: Any) -> str:
    """A Tool object's permissions in one cell: what it declares, 'none', or 'undeclared' (no block)."""
    if not isinstance(permissions, dict):
        return "undeclared"
    parts = []
    if permissions.get("network"):
        parts.append("network " + ",".join(map(str, permissions["network"])))
    if permissions.get("env"):
        parts.append("env " + ",".join(map(str, permissions["env"])))
    if permissions.get("email", "none") != "none":
        parts.append(f"email {permissions['email']}")
    if permissions.get("browser"):
        parts.append("browser")
    return "; ".join(parts) or "none"


def _skipped_dict(entry: Skipped) -> dict[str, Any]:
    return {"dir": str(entry.dir), "source": entry.source, "problems": [p.to_dict() for p in entry.problems]}


def show_tool(args: argparse.Namespace, config: Config) -> int:
    try:
        served = _from_daemon(args, config)
    except _DaemonFailed as exc:
        return fail(str(exc))
    if served is not None:
        return _show_served(args, served)
    tools, skipped = ToolCatalog(config.data_path).scan(args.user)
    tool = next((t for t in tools if t.name == args.name), None)
    if tool is None:
        message = f"unknown tool {args.name}; `sandboxd tools list` shows the tools"
        broken = next((entry for entry in skipped if entry.dir.name == args.name), None)
        if broken is not None and broken.problems:
            message += f" (the directory {broken.dir} is skipped: {broken.problems[0]})"
        return fail(message)
    if args.json:
        _print_json(tool.to_protocol())
        return EXIT_OK
    manifest = tool.manifest
    print(f"{manifest.name} — {manifest.label}")
    print(f"version:     {manifest.version}")
    print(f"source:      {tool.source}")
    print(f"language:    {manifest.language}")
    print(f"path:        {tool.dir}")
    print(f"entry:       {tool.entry.name}")
    print(f"description: {manifest.description}")
    print(f"permissions: {permissions_summary(manifest.permissions.to_protocol())}")
    print("\ninputSchema:")
    print(json.dumps(tool.schema, indent=2, ensure_ascii=False))
    print("\ndocumentation:")
    print(manifest.body)
    return EXIT_OK


def _show_served(args: argparse.Namespace, served: list[dict[str, Any]]) -> int:
    """``tools show`` from the daemon's Tool objects (which carry no path: the daemon's disk is its own)."""
    tool = next((t for t in served if t.get("name") == args.name), None)
    if tool is None:
        user = f" for {args.user}" if args.user is not None else " (global tools only: add --user U for a user's)"
        return fail(f"the daemon serves no tool {args.name}{user}; `sandboxd tools list` shows the tools")
    if args.json:
        _print_json(tool)
        return EXIT_OK
    print(f"{tool['name']} — {tool['label']}")
    print(f"version:     {tool['version']}")
    print(f"source:      {tool['source']}")
    print(f"language:    {tool['language']}")
    print(f"description: {tool['description']}")
    print(f"permissions: {permissions_summary(tool.get('permissions'))}")
    print("\ninputSchema:")
    print(json.dumps(tool["inputSchema"], indent=2, ensure_ascii=False))
    print("\ndocumentation:")
    print(tool["documentation"])
    return EXIT_OK


# --- sync --------------------------------------------------------------------------------------


def sync_command(args: argparse.Namespace, config: Config) -> int:
    seed = config.seed_tools
    if seed is None:
        return fail("no seed tools directory is configured; pass --seed-tools DIR or set seed_tools in the config")
    if not seed.is_dir():
        return fail(f"seed tools directory {seed} does not exist; pass an existing directory to --seed-tools")
    for action in sync_tools(seed, global_tools_dir(config.data_path)):
        print(action)
    return EXIT_OK


# --- validate ----------------------------------------------------------------------------------


def validate_command(args: argparse.Namespace, config: Config) -> int:
    problems = validate_paths(args.paths, data_path=config.data_path, required=config.tools.require_permissions)
    synced = global_tools_dir(config.data_path)
    # Which data the bump check read: a wrong data path would make it pass silently.
    if synced.is_dir():
        _note(f"version bumps checked against the synced tools in {synced}")
    else:
        _note(f"version bumps not checked: {synced} does not exist (the daemon's data elsewhere? pass --data-path)")
    errors = sum(p.is_error for p in problems)
    if args.json:
        _print_json({"problems": [p.to_dict() for p in problems], "errors": errors, "warnings": len(problems) - errors})
    else:
        for problem in problems:
            print(problem)
        warnings = len(problems) - errors
        print(f"{errors} error{'s' * (errors != 1)}, {warnings} warning{'s' * (warnings != 1)}")
    return EXIT_FAILURE if errors else EXIT_OK
