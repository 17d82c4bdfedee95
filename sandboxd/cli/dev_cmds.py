"""`sandboxd new` and `sandboxd run`: the tool developer's loop (docs/tool-development.md)."""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import shutil
import signal
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from sandboxd.cli.common import (EXIT_FAILURE, EXIT_OK, EXIT_USAGE, add_argument_flags, fail, parse_tool_arguments,
                                 print_progress, print_result, user_argument)
from sandboxd.config import Config
from sandboxd.dev.session import BackendChoice, DevSession, choose_backend, dev_spec, requested_backend, user_storage
from sandboxd.dev.watch import changed_files, snapshot, wait_for_change
from sandboxd.errors import InvalidParams, SandboxdError
from sandboxd.logging import configure_logging
from sandboxd.storage.quota import Storage
from sandboxd.tools.discovery import ENTRY_FILES, Tool
from sandboxd.tools.manifest import MANIFEST_FILE
from sandboxd.dev.scaffold import ScaffoldError, scaffold_tool
from sandboxd.tools.schema import validate_arguments
from sandboxd.dev.lint.validation import validate_tool_dir

EXIT_INTERRUPTED = 130


def add_commands(subparsers: argparse._SubParsersAction, parent: argparse.ArgumentParser) -> None:
    new = subparsers.add_parser(
        "new", parents=[parent], help="create a new tool folder from the recommended template",
        description="Create the folder NAME with a TOOL.md (version 1, an example input, the recommended "
                    "sections) and a typed index.ts (ok()/err() helpers, try/catch, onUpdate). It validates "
                    "cleanly and runs as it is. Refuses names that are not snake_case and folders that exist.")
    new.add_argument("name", metavar="NAME", help="the tool's name, in snake_case (e.g. weather)")
    new.add_argument("--dir", type=Path, default=Path("."), metavar="DIR",
                     help="where to create the folder NAME (default: the current directory)")
    new.set_defaults(handler=new_command)

    run = subparsers.add_parser(
        "run", parents=[parent], help="run a tool from its folder, without installing it",
        description="Run a tool from any folder in the kind of sandbox the service uses: a Docker container "
                    "from the runner image with the same limits and mounts, the tool's folder read-only at "
                    "/officer/user/tools/<folder>. With --backend process (never by itself) the tool runs as "
                    "a local node process, UNSANDBOXED. Progress and the tool's console output go to stderr, "
                    "the result to stdout. Ctrl-C fires the tool's AbortSignal and shows its result; a second "
                    "Ctrl-C kills it. Exit status: 0 ok, 1 the tool failed or is invalid, 2 usage or no backend, "
                    "130 when --watch is stopped with Ctrl-C.")
    run.add_argument("path", type=Path, metavar="PATH", help="the tool's folder (or its TOOL.md or entry file)")
    add_argument_flags(run)
    run.add_argument("--user", type=user_argument, metavar="U",
                     help="use DATA_PATH/U as the user data directory /officer/user (default: an empty scratch "
                          "directory, removed afterwards)")
    run.add_argument("--timeout", type=float, metavar="S",
                     help="deadline in seconds (default: calls.default_timeout_ms; capped by calls.max_timeout_ms)")
    run.add_argument("--watch", action="store_true",
                     help="keep the sandbox warm and run again whenever a file in the tool's folder changes")
    run.add_argument("--backend", dest="run_backend", choices=["docker", "process"],
                     help="docker (default; without Docker and the runner image, run stops and says so) or "
                          "process, which runs the tool UNSANDBOXED (also: SANDBOXD_BACKEND=process)")
    run.add_argument("--raw", action="store_true",
                     help="print the raw result object as JSON, with \"backend\" and \"unsandboxed\"")
    run.set_defaults(handler=run_command)


def _shown(path: Path) -> str:
    """A path as the user would type it: relative to the current directory when it is below it."""
    try:
        return str(path.relative_to(Path.cwd()))
    except ValueError:
        return str(path)


def _say(message: str) -> None:
    print(f"sandboxd: {message}", file=sys.stderr, flush=True)


# --- new ---------------------------------------------------------------------------------------


def new_command(args: argparse.Namespace, config: Config) -> int:
    try:
        files = scaffold_tool(args.name, args.dir)
    except ScaffoldError as exc:
        return fail(str(exc), EXIT_USAGE)
    for path in files:
        print(f"created {_shown(path.absolute())}")
    folder = _shown(files[0].parent.absolute())
    print(f"next: sandboxd run {folder}    (it runs as it is; then make it yours: rename the input city in "
          f"{folder}/TOOL.md and {folder}/index.ts, and check with `sandboxd validate {folder}`)")
    return EXIT_OK


# --- run ---------------------------------------------------------------------------------------


class _Usage(Exception):
    pass


def _tool_dir(path: Path) -> Path:
    if not path.exists():
        raise _Usage(f"{path} does not exist; pass a tool folder (create one with `sandboxd new NAME`)")
    folder = path.resolve()
    if folder.is_file():
        folder = folder.parent
    if not any((folder / name).exists() for name in (MANIFEST_FILE, *ENTRY_FILES)):
        raise _Usage(f"{path} is not a tool folder: it has no {MANIFEST_FILE} or {ENTRY_FILES[0]}; "
                     "create one with `sandboxd new NAME`")
    return folder


def _timeout(args: argparse.Namespace, config: Config) -> float:
    ceiling = config.calls.max_timeout_ms / 1000
    if args.timeout is None:
        return min(config.calls.default_timeout_ms / 1000, ceiling)
    if not args.timeout > 0:
        raise _Usage("--timeout must be a positive number of seconds")
    if args.timeout > ceiling:
        _say(f"--timeout {args.timeout:g} is capped at {ceiling:g} s (calls.max_timeout_ms)")
    return min(args.timeout, ceiling)


def _load(tool_dir: Path, arguments: dict[str, Any]) -> tuple[Tool, dict[str, Any]] | int:
    """The tool and its checked arguments, or the exit status after saying what is wrong.

    Every finding is shown; only manifest errors stop the run (the code checks are
    heuristics, and running the tool shows what really happens).
    """
    tool, problems = validate_tool_dir(tool_dir, tool_dir.parent)
    for problem in problems:
        print(dataclasses.replace(problem, path=Path(_shown(problem.path))), file=sys.stderr)
    if tool is None:
        _say(f"not running {tool_dir.name}: fix the errors above (`sandboxd validate {_shown(tool_dir)}`)")
        return EXIT_FAILURE
    try:
        checked = validate_arguments(tool.schema, arguments, tool=tool.name)
    except InvalidParams as exc:
        return fail(f"{exc.message} (pass arguments with --arg KEY=VALUE or --json OBJECT)", EXIT_USAGE)
    # A user tool, as the sandbox mounts it at /officer/user/tools/<folder>.
    return dataclasses.replace(tool, source="user"), checked


def run_command(args: argparse.Namespace, config: Config) -> int:
    try:
        tool_dir = _tool_dir(args.path)
        arguments = parse_tool_arguments(args)
        timeout_s = _timeout(args, config)
        requested = requested_backend(args.run_backend, config)
    except (_Usage, ValueError) as exc:
        return fail(str(exc), EXIT_USAGE)
    except SandboxdError as exc:
        return fail(exc.message, EXIT_USAGE)
    loaded: tuple[Tool, dict[str, Any]] | None = None
    if not args.watch:
        checked = _load(tool_dir, arguments)  # before any sandbox starts: a broken tool fails fast
        if isinstance(checked, int):
            return checked
        loaded = checked
    configure_logging("error", "console")  # the pool's own events would only repeat what is printed here
    try:
        choice = choose_backend(requested, config)
    except SandboxdError as exc:
        return fail(exc.message, EXIT_USAGE)
    storage = user_storage(config) if args.user else None  # DATA_PATH/U under the quota, as the daemon makes it
    try:
        return asyncio.run(_session(args, config, choice, tool_dir, arguments, timeout_s, loaded, storage))
    finally:
        if storage is not None:
            storage.close()


async def _session(args: argparse.Namespace, config: Config, choice: BackendChoice, tool_dir: Path,
                   arguments: dict[str, Any], timeout_s: float, loaded: tuple[Tool, dict[str, Any]] | None,
                   storage: Storage | None) -> int:
    scratch = Path(tempfile.mkdtemp(prefix="sandboxd-run-"))
    spec = dev_spec(config, tool_dir, scratch, args.user, mount_tool=choice.backend.name == "docker",
                    provision=storage.provision if storage is not None else None)
    session = DevSession(config, choice, spec, keep_warm=args.watch,
                         on_tool_output=lambda line: print(line, file=sys.stderr, flush=True))
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()

    def on_interrupt() -> None:
        action = session.interrupt()
        if action is None:  # between runs: stop watching
            stop.set()
        elif action == "cancel":
            _say("Ctrl-C: the tool's AbortSignal fired; waiting for its result (Ctrl-C again to kill it)")
        elif action == "kill":
            _say("Ctrl-C again: killing the tool's sandbox")

    loop.add_signal_handler(signal.SIGINT, on_interrupt)
    _describe(choice, config, tool_dir)
    try:
        if loaded is not None:  # a single run, of the tool checked before the backend was chosen
            code = await _run_once(session, choice, tool_dir, arguments, timeout_s, args.raw, loaded)
            if code == EXIT_OK:
                _say(_next_steps(tool_dir, loaded[0], arguments, config.data_path))
            return code
        runs, changes = 0, list[str]()
        while True:
            before = await asyncio.to_thread(snapshot, tool_dir)
            runs += 1
            _separator(tool_dir.name, runs, changes, choice)
            await _run_once(session, choice, tool_dir, arguments, timeout_s, args.raw)
            if stop.is_set():
                return EXIT_INTERRUPTED
            _say(f"watching {_shown(tool_dir)} for changes (Ctrl-C to stop)")
            after = await wait_for_change(tool_dir, before, stop)
            if after is None:
                return EXIT_INTERRUPTED
            changes = changed_files(before, after)
    finally:
        loop.remove_signal_handler(signal.SIGINT)  # a Ctrl-C during cleanup interrupts it for real
        await session.close()
        shutil.rmtree(scratch, ignore_errors=True)


async def _run_once(session: DevSession, choice: BackendChoice, tool_dir: Path, arguments: dict[str, Any],
                    timeout_s: float, raw: bool, loaded: tuple[Tool, dict[str, Any]] | int | None = None) -> int:
    if loaded is None:
        loaded = await asyncio.to_thread(_load, tool_dir, arguments)
    if isinstance(loaded, int):
        return loaded
    tool, checked = loaded
    try:
        outcome = await session.call(tool, checked, timeout_s, lambda content: print_progress({"content": content}))
    except SandboxdError as exc:  # no sandbox could be started
        return fail(exc.message, EXIT_USAGE)
    if raw:
        print(json.dumps({**outcome, "backend": choice.backend.name, "unsandboxed": choice.unsandboxed}, indent=2),
              flush=True)
    else:
        print_result(outcome)
        sys.stdout.flush()
    return EXIT_OK if outcome.get("status") == "ok" else EXIT_FAILURE


def _next_steps(tool_dir: Path, tool: Tool, arguments: dict[str, Any], data_path: Path) -> str:
    """What a developer does after a first successful run: other inputs, --watch, validate, install."""
    folder = _shown(tool_dir)
    inputs = list(tool.schema.get("properties", {}))
    steps = []
    if inputs:
        example = next((name for name in inputs if name not in arguments), inputs[0])
        steps.append(f"try other inputs with `sandboxd run {folder} --arg {example}=VALUE`")
    steps.append(f"rerun on every save with `sandboxd run {folder} --watch`")
    steps.append(f"check with `sandboxd validate {folder}`")
    steps.append(f"install it for a user by copying {folder} to {data_path}/<user>/tools/ "
                 "(docs/tool-development.md, \"Install it\")")
    return "next: " + "; ".join(steps)


def _describe(choice: BackendChoice, config: Config, tool_dir: Path) -> None:
    if choice.unsandboxed:
        _say(f"UNSANDBOXED ({choice.reason}): {tool_dir.name} runs as a local node process with your rights, "
             "your files and your network, not in a sandbox. Docker and `make image` run it as the service does.")
    else:
        _say(f"running {tool_dir.name} in a Docker sandbox ({config.sandbox.image}, network {config.sandbox.network})")


def _separator(name: str, run: int, changes: list[str], choice: BackendChoice) -> None:
    parts = [name, f"run {run}", time.strftime("%H:%M:%S")]
    if changes:
        parts.append(", ".join(changes[:3]) + (f" and {len(changes) - 3} more" if len(changes) > 3 else "") + " changed")
    if choice.unsandboxed:
        parts.append("UNSANDBOXED")
    print(f"──── {' · '.join(parts)} ────", file=sys.stderr, flush=True)

