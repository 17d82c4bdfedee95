"""`sandboxd serve`: sync the seed tools, then answer pi-bridge on the socket."""

from __future__ import annotations

import argparse
import asyncio
from pathlib import Path
from typing import Callable

from sandboxd.cli.common import EXIT_FAILURE, EXIT_OK, config_overrides, fail
from sandboxd.config import Config, ConfigError, check_unsandboxed, config_file, env_keys, load_config, unsafe_settings
from sandboxd.logging import configure_logging, get_logger, set_log_budget


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


def event_loop_factory(choice: str) -> Callable[[], asyncio.AbstractEventLoop] | None:
    """The loop `serve` runs on (config event_loop); None is asyncio's default."""
    if choice == "asyncio":
        return None
    try:
        import uvloop
    except ImportError:
        if choice == "uvloop":
            raise ConfigError("event_loop is uvloop, but uvloop is not installed: pip install uvloop, "
                              "or set event_loop: asyncio.") from None
        return None
    return uvloop.new_event_loop


def log_configuration(args: argparse.Namespace, config: Config) -> None:
    """Where the configuration came from, and the settings an operator asks about first: what
    sandboxes may reach (the egress policy and its allow list) and how they are networked."""
    path = config_file(args.config)
    flags = sorted(f"--{key.replace('_', '-')}" for key, value in config_overrides(args).items() if value is not None)
    get_logger("sandboxd.serve").info(
        "configuration", file=str(path) if path is not None else None,
        environment=env_keys(), flags=flags,
        data_path=str(config.data_path), egress_policy=config.egress.policy, egress_allow=list(config.egress.allow),
        egress_ports=list(config.egress.ports), sandbox_network=config.sandbox.network)


def run_serve(args: argparse.Namespace, config: Config) -> int:
    from sandboxd.server.server import serve
    from sandboxd.service.systemd import listen_socket

    check_unsandboxed(config)  # `sandboxd run` asks for the process backend by flag; a service must say so
    loop_factory = event_loop_factory(config.event_loop)
    configure_logging(config.log_level, config.log_format)
    set_log_budget(config.log_rate, config.log_burst)
    log_configuration(args, config)
    accepted = [name for name, _ in unsafe_settings(config) if name in config.allow_unsafe]
    if accepted:  # said at every start, so nobody forgets the sandbox is weakened
        get_logger("sandboxd.serve").warning("UNSAFE_SETTINGS", accepted=accepted,
                                             detail="allow_unsafe accepts settings that weaken every sandbox")

    def reload_config() -> Config:
        # The same sources as at start-up: the file, SANDBOXD_* variables, then these flags.
        return load_config(args.config, overrides=config_overrides(args))

    try:
        activated = listen_socket()  # the socket of sandboxd.socket, when systemd passed one
        with asyncio.Runner(loop_factory=loop_factory) as runner:
            runner.run(serve(config, listen_socket=activated, reload_config=reload_config))
    except OSError as exc:
        return fail(str(exc), EXIT_FAILURE)
    return EXIT_OK
