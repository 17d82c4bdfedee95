"""Reload: what a SIGHUP may change live, what it keeps until a restart, and a bad file."""

from __future__ import annotations

import asyncio
import io
import json
import tempfile
from pathlib import Path
from typing import Any

import pytest

from sandboxd.config import Config, load_config, needs_restart
from sandboxd.errors import ConfigError
from sandboxd.logging import configure_logging, get_logger
from sandboxd.sandbox.backend import OutputLimits
from sandboxd.sandbox.fake import FakeBackend
from sandboxd.server.server import Server
from tests.unit.test_metrics import call, handler
from tests.unit.test_server import hello_tree


@pytest.mark.parametrize(
    "key, restart",
    [
        ("pool.max_per_user", False), ("pool.idle_ttl_s", False), ("calls.default_timeout_ms", False),
        ("calls.allowed_env", False), ("sandbox.memory", False), ("log_level", False), ("allowed_uids", False),
        ("calls.max_result_bytes", True), ("sandbox.docker_host", True), ("socket", True), ("data_path", True),
        ("backend", True), ("metrics.listen", True), ("log_format", True), ("socket_group", True),
        ("some_future_key", True),  # unknown keys are never applied live
    ],
)
def test_which_keys_need_a_restart(key: str, restart: bool) -> None:
    assert needs_restart(key) is restart


def run(tmp_path: Path, test: Any, *, tool: Any = handler, backend: Any = FakeBackend, **settings: Any) -> None:
    with tempfile.TemporaryDirectory(prefix="sbd-") as short_dir:  # a socket's path is at most 108 bytes
        serve_for(tmp_path, Path(short_dir) / "s.sock", test, tool=tool, backend=backend, **settings)


def serve_for(tmp_path: Path, socket: Path, test: Any, *, tool: Any, backend: Any, **settings: Any) -> None:
    base = {"data_path": tmp_path / "data", "socket": socket, "seed_tools": None, "backend": "fake"}

    def configure(**changes: Any) -> Config:
        return load_config(environ={}, overrides=base | settings | changes)

    async def main() -> None:
        hello_tree(tmp_path / "data")
        server = Server(configure(), backend(tool))
        await server.startup()
        try:
            await test(server, configure)
        finally:
            await server.shutdown()

    asyncio.run(main())


def test_live_keys_apply_and_restart_keys_are_kept(tmp_path: Path) -> None:
    stream = io.StringIO()
    configure_logging("info", "json", stream)

    async def test(server: Server, configure: Any) -> None:
        socket_path = server.config.socket
        applied, ignored = server.apply_config(configure(
            pool={"max_per_user": 7, "min_idle": 0}, calls={"default_timeout_ms": 1234, "max_result_bytes": 4096},
            allowed_uids=[4321], log_level="debug", socket=socket_path.parent / "other.sock",
            metrics={"listen": "127.0.0.1:0"},
        ))
        assert sorted(applied) == ["allowed_uids", "calls.default_timeout_ms", "log_level", "pool.max_per_user", "pool.min_idle"]
        assert sorted(ignored) == ["calls.max_result_bytes", "metrics.listen", "socket"]
        # The server, runner and pool all see the same, merged configuration.
        assert server.runner.config is server.config and server.pool.config is server.config.pool
        assert server.config.pool.max_per_user == 7 and server.config.calls.default_timeout_ms == 1234
        assert server.config.socket == socket_path and server.config.calls.max_result_bytes == 1 << 20
        assert server.config.metrics.listen is None
        assert server.peer_policy.uids == {4321}
        assert server.status()["limits"]["maxPerUser"] == 7
        get_logger("test").debug("now_visible")

    run(tmp_path, test)
    events = [json.loads(line) for line in stream.getvalue().splitlines()]
    reload_event = next(e for e in events if e["event"] == "config_reloaded")
    assert "pool.max_per_user" in reload_event["applied"]
    warning = next(e for e in events if e["event"] == "config_needs_restart")
    assert sorted(warning["keys"]) == sorted(reload_event["needs_restart"]) == ["calls.max_result_bytes", "metrics.listen", "socket"]
    assert warning["level"] == "warning"
    assert any(e["event"] == "now_visible" for e in events)


def test_new_sandbox_settings_replace_idle_sandboxes_now_and_busy_ones_after_their_call(tmp_path: Path) -> None:
    release = asyncio.Event()

    async def gated(request: Any, on_progress: Any, aborted: asyncio.Event) -> dict[str, Any]:
        if request.arguments["name"] == "gated":
            await release.wait()  # busy until the test lets it finish, well within its deadline
        return await handler(request, on_progress, aborted)

    async def test(server: Server, configure: Any) -> None:
        backend = server.backend
        await call(server, "World")  # leaves one idle sandbox (min_idle 1)
        busy = asyncio.get_running_loop().create_task(call(server, "gated"))
        await asyncio.sleep(0.05)  # the second sandbox is busy with the gated call
        before = set(backend.sandboxes)
        assert len(before) == 2
        server.apply_config(configure(sandbox={"memory": "512m"}, pool={"min_idle": 1}))
        await asyncio.sleep(0.05)
        assert len(backend.destroyed) == 1  # the idle one, at once
        assert len(before & set(backend.sandboxes)) == 1  # the busy one is left to finish its call
        release.set()
        reply = await busy
        assert reply["result"]["status"] == "ok"  # it was not failed or timed out: only the reload retires it
        await asyncio.sleep(0.05)
        assert before.isdisjoint(backend.sandboxes)
        assert len(backend.sandboxes) == 1  # min_idle, under the new settings

    run(tmp_path, test, tool=gated, pool={"min_idle": 1})


def test_a_reload_of_the_output_budget_reaches_the_next_call(tmp_path: Path) -> None:
    # The runner makes a call's OutputLimits once per configuration: a reload must make new ones.
    async def test(server: Server, configure: Any) -> None:
        def limits() -> OutputLimits:
            (sandbox,) = (s for s in server.backend.sandboxes.values() if s.last_call is not None)
            return sandbox.last_call[1].output_limits

        assert (await call(server, "World"))["result"]["status"] == "ok"
        assert limits() == OutputLimits(1 << 20, 4 << 20, 4 << 20)  # the defaults
        server.apply_config(configure(calls={"output_rate_bytes": 5000, "output_burst_bytes": 6000,
                                             "idle_output_bytes": 7000}))
        assert (await call(server, "World"))["result"]["status"] == "ok"
        assert limits() == OutputLimits(5000, 6000, 7000)

    run(tmp_path, test, pool={"min_idle": 0, "max_per_user": 1})


def test_a_bad_file_keeps_the_running_configuration(tmp_path: Path) -> None:
    stream = io.StringIO()
    configure_logging("info", "json", stream)
    bad = tmp_path / "bad.yaml"
    bad.write_text("pool:\n  max_per_user: 0\n")

    async def test(server: Server, configure: Any) -> None:
        before = server.config
        assert await server.reload(lambda: load_config(bad, environ={})) is False
        assert server.config is before
        assert await server.reload(lambda: configure(pool={"max_per_user": 2})) is True
        assert server.config.pool.max_per_user == 2

    run(tmp_path, test)
    failure = next(json.loads(line) for line in stream.getvalue().splitlines() if '"config_reload_failed"' in line)
    assert "pool.max_per_user" in failure["error"] and failure["level"] == "error"


class RuntimeCheckingBackend(FakeBackend):
    """A backend whose engine knows no runtime "nosuchruntime", as Docker's preflight would say."""

    async def preflight(self, config: Any = None) -> None:
        if config is not None and config.runtime == "nosuchruntime":
            raise ConfigError("sandbox.runtime is 'nosuchruntime', which the Docker engine does not know; "
                              "register it in the engine's daemon.json (\"runtimes\") or unset sandbox.runtime")


def test_a_reload_start_up_would_refuse_keeps_the_running_configuration(tmp_path: Path) -> None:
    stream = io.StringIO()
    configure_logging("info", "json", stream)

    async def test(server: Server, configure: Any) -> None:
        backend = server.backend
        assert isinstance(backend, FakeBackend)
        before = server.config
        assert await server.reload(lambda: configure(sandbox={"runtime": "nosuchruntime"}, pool={"max_per_user": 3})) is False
        assert server.config is before and not backend.reconfigured  # nothing of it applied, not even pool
        assert await server.reload(lambda: configure(sandbox={"memory": "512m"})) is True  # a good one still applies
        assert server.config.sandbox.memory == "512m"

    run(tmp_path, test, backend=RuntimeCheckingBackend)
    failure = next(json.loads(line) for line in stream.getvalue().splitlines() if '"config_reload_failed"' in line)
    assert "'nosuchruntime', which the Docker engine does not know" in failure["error"], failure
    assert "running configuration is unchanged" in failure["hint"], failure



def test_a_config_change_keeps_restart_keys_as_they_run_and_says_which_applied(tmp_path: Path) -> None:
    from sandboxd.server.reload import config_change

    base = {"data_path": tmp_path, "socket": tmp_path / "s.sock", "backend": "fake"}
    running = load_config(environ={}, overrides=base)
    new = load_config(environ={}, overrides=base | {"socket": tmp_path / "other.sock", "pool": {"max_per_user": 9},
                                                    "sandbox": {"memory": "300m"}})
    change = config_change(running, new)
    assert sorted(change.applied) == ["pool.max_per_user", "sandbox.memory"] and change.needs_restart == ["socket"]
    assert change.config.socket == running.socket and change.config.pool.max_per_user == 9
    assert change.touches("sandbox") and not change.touches("calls")
    unchanged = config_change(running, running)
    assert unchanged.config is running and unchanged.applied == unchanged.needs_restart == []


def test_a_reload_whose_sandboxes_the_descriptor_limit_cannot_hold_is_refused(tmp_path: Path) -> None:
    stream = io.StringIO()
    configure_logging("info", "json", stream)

    async def test(server: Server, configure: Any) -> None:
        assert server.fd_budget is not None and server.clients is not None
        limit, before = server.fd_budget.limit, server.config
        too_many = (limit // server.fd_budget.per_sandbox) + 1  # start-up would refuse this many at this limit
        assert await server.reload(lambda: configure(pool={"max_total": too_many})) is False
        assert server.config is before
        assert await server.reload(lambda: configure(pool={"max_total": 2})) is True  # fewer: the clients get more
        assert server.clients.budget is server.fd_budget and server.fd_budget.sandboxes == 2 * server.fd_budget.per_sandbox

    run(tmp_path, test)
    failure = next(json.loads(line) for line in stream.getvalue().splitlines() if '"config_reload_failed"' in line)
    assert "file descriptor limit" in failure["error"] and "pool.max_total" in failure["error"], failure
