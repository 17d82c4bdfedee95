"""`sandboxd serve`: sync the seed tools, then answer pi-bridge on the socket."""

from __future__ import annotations

import argparse
import asyncio
from pathlib import Path

from sandboxd.cli.main import EXIT_FAILURE, EXIT_OK, config_overrides, fail
from sandboxd.config import Config, check_unsandboxed, load_config, unsafe_settings
from sandboxd.logging import configure_logging, get_logger


def add_commands(subparsers: argparse._SubParsersAction, parent: argparse.ArgumentParser) -> None:
    p = subparsers.add_parser(
        "serve", parents=[parent], help="run the daemon",
        description="Sync the seed tools into DATA_PATH/tools, then serve the wire protocol on a unix socket "
                    "until SIGTERM or SIGINT. SIGHUP re-reads the configuration. Under systemd it reports readiness "
                    "(Type=notify) and takes the socket from sandboxd.socket when socket-activated.",
    )
    p.add_argument("--socket", type=Path, metavar="PATH", help="unix socket to listen on")
    p.add_argument("--seed-tools", type=Path, metavar="DIR", help="seed tools to sync at start")
    p.add_argument("--backend", choices=["docker", "process"], help="sandbox backend (process = UNSANDBOXED, for development; needs allow_unsafe: [unsandboxed])")
    p.add_argument("--log-level", choices=["debug", "info", "warning", "error"])
    p.set_defaults(handler=run_serve)


def run_serve(args: argparse.Namespace, config: Config) -> int:
    from sandboxd.server.server import serve
    from sandboxd.service.systemd import listen_socket

    check_unsandboxed(config)  # `sandboxd run` asks for the process backend by flag; a service must say so
    configure_logging(config.log_level, config.log_format)
    accepted = [name for name, _ in unsafe_settings(config) if name in config.allow_unsafe]
    if accepted:  # said at every start, so nobody forgets the sandbox is weakened
        get_logger("sandboxd.serve").warning("UNSAFE_SETTINGS", accepted=accepted,
                                             detail="allow_unsafe accepts settings that weaken every sandbox")

    def reload_config() -> Config:
        # The same sources as at start-up: the file, SANDBOXD_* variables, then these flags.
        return load_config(args.config, overrides=config_overrides(args))

    try:
        activated = listen_socket()  # the socket of sandboxd.socket, when systemd passed one
        asyncio.run(serve(config, listen_socket=activated, reload_config=reload_config))
    except OSError as exc:
        return fail(str(exc), EXIT_FAILURE)
    return EXIT_OK
