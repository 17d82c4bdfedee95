"""The descriptor budget (service/fds.py): its arithmetic, the start-up refusal, the clients'
shares over a real socket, and a sandbox's egress accepts held to its share."""

from __future__ import annotations

import asyncio
import resource
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from sandboxd.config import ConfigError, load_config
from sandboxd.egress.contract import EgressCall
from sandboxd.rules.secrets import StandIns
from sandboxd.service import fds
from sandboxd.service.fds import (CLIENT_REFUSING, EGRESS_REFUSING, RELAY_PIPE_FDS, RESERVED_FDS, SANDBOX_OWN_FDS,
                                  ClientShares, FdBudget, raise_nofile_limit)
from tests.unit.test_egress import make_proxy
from tests.unit.test_server import Harness, serving


def config(**overrides: Any) -> Any:
    return load_config(overrides=overrides, environ={})


def test_the_defaults_under_the_units_limit_give_each_sandbox_its_tunnels_and_clients_the_rest() -> None:
    budget = FdBudget.plan(config(), 65536)
    per_sandbox = 2 * 32 + EGRESS_REFUSING + SANDBOX_OWN_FDS
    assert (budget.reserved, budget.per_sandbox, budget.sandboxes) == (RESERVED_FDS, per_sandbox, 32 * per_sandbox)
    assert budget.clients == 65536 - RESERVED_FDS - RELAY_PIPE_FDS - 32 * per_sandbox
    assert budget.per_client == (budget.clients - CLIENT_REFUSING) // 4
    # Everything at its share fits the limit with the reserve untouched, the relay's pipes counted.
    assert budget.reserved + budget.pipes + budget.sandboxes + budget.clients == budget.limit


def test_the_defaults_do_not_fit_1024_and_the_refusal_names_the_keys_and_the_fix() -> None:
    """32 sandboxes x 32 tunnels x 2 descriptors is 2048 alone: systemd's default soft limit cannot hold it."""
    with pytest.raises(ConfigError) as refused:
        FdBudget.plan(config(), 1024)
    message = refused.value.message
    need = RESERVED_FDS + RELAY_PIPE_FDS + 32 * (2 * 32 + EGRESS_REFUSING + SANDBOX_OWN_FDS) + fds.MIN_CLIENT_FDS
    for words in ("(1024, RLIMIT_NOFILE)", "pool.max_total (32)", "egress.max_connections (32)", f"needs {need}",
                  f"{RELAY_PIPE_FDS} for the egress relay's pipes",
                  f"at least {need} (LimitNOFILE=", "lower pool.max_total or egress.max_connections"):
        assert words in message, message
    assert FdBudget.plan(config(), need).clients == fds.MIN_CLIENT_FDS  # exactly enough is enough


def test_a_smaller_pool_or_fewer_tunnels_fit_1024() -> None:
    small_pool = FdBudget.plan(config(pool={"max_total": 8, "reserve": 1}), 1024)
    assert small_pool.clients == 1024 - RESERVED_FDS - RELAY_PIPE_FDS - 8 * small_pool.per_sandbox
    few_tunnels = FdBudget.plan(config(egress={"max_connections": 4}), 1024)
    assert few_tunnels.per_sandbox == 2 * 4 + EGRESS_REFUSING + SANDBOX_OWN_FDS


def test_max_client_connections_is_used_when_it_fits_and_refused_when_it_does_not() -> None:
    assert FdBudget.plan(config(max_client_connections=100), 4096).per_client == 100
    clients = FdBudget.plan(config(), 4096).clients
    with pytest.raises(ConfigError, match=rf"max_client_connections \(5000\) does not fit .* at most "
                                          rf"{clients - CLIENT_REFUSING}"):
        FdBudget.plan(config(max_client_connections=5000), 4096)


def test_each_uid_is_served_to_its_share_refused_a_few_more_then_dropped_and_others_go_on() -> None:
    budget = FdBudget(limit=1000, reserved=0, per_sandbox=0, sandboxes=0, clients=20, per_client=3)
    shares = ClientShares(budget)
    verdicts = [shares.admit(1000) for _ in range(3 + CLIENT_REFUSING + 2)]
    assert verdicts == ["serve"] * 3 + ["refuse"] * CLIENT_REFUSING + ["drop"] * 2
    assert (shares.served[1000], shares.refusing[1000], shares.total) == (3, CLIENT_REFUSING, 3 + CLIENT_REFUSING)
    assert "uid 1000 already holds 3 connections" in shares.refusal(1000)
    assert shares.admit(0) == "serve"  # another uid is not touched by the first one's flood
    shares.release(1000, "refuse")
    assert shares.admit(1000) == "refuse"  # a refusal answered: room for the next one's answer
    shares.release(1000, "serve")
    assert shares.admit(1000) == "serve"  # one of its 3 closed: served again


def test_accepting_stops_while_every_client_descriptor_is_in_use_and_resumes_at_the_first_free() -> None:
    shares = ClientShares(FdBudget(limit=100, reserved=0, per_sandbox=0, sandboxes=0, clients=2, per_client=5))
    resumed: list[bool] = []
    shares.admit(1)
    shares.admit(2)
    assert shares.full
    shares.when_room = lambda: resumed.append(True)
    shares.release(1, "serve")
    assert resumed == [True] and not shares.full and shares.when_room is None
    shares.release(2, "serve")
    assert resumed == [True]  # once


def test_the_daemon_raises_its_soft_limit_to_the_hard_one() -> None:
    def limited() -> None:
        resource.setrlimit(resource.RLIMIT_NOFILE, (1024, 4096))

    out = subprocess.run([sys.executable, "-c", "from sandboxd.service.fds import raise_nofile_limit as r; print(r())"],
                         preexec_fn=limited, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "(1024, 4096, 4096)"


def test_a_denied_raise_keeps_the_soft_limit_and_says_how_to_set_it(monkeypatch: pytest.MonkeyPatch,
                                                                      capsys: pytest.CaptureFixture[str]) -> None:
    """As under the unit's SystemCallFilter=~@resources: setrlimit fails with EPERM."""
    monkeypatch.setattr(resource, "getrlimit", lambda _which: (1024, 4096))

    def denied(_which: int, _limits: Any) -> None:
        raise PermissionError(1, "Operation not permitted")

    monkeypatch.setattr(resource, "setrlimit", denied)
    assert raise_nofile_limit() == (1024, 4096, 1024)


def test_serve_refuses_a_configuration_the_limit_cannot_hold_with_exit_2(tmp_path: Path) -> None:
    """Before it binds the socket or takes the data path: nothing is left to undo."""
    cfg = tmp_path / "config.yaml"
    cfg.write_text("backend: fake\n")
    sock = tmp_path / "s.sock"

    def limited() -> None:
        resource.setrlimit(resource.RLIMIT_NOFILE, (1024, 1024))

    run = subprocess.run([sys.executable, "-m", "sandboxd", "serve", "--config", str(cfg), "--socket", str(sock),
                          "--data-path", str(tmp_path / "data"), "--seed-tools", str(tmp_path)],
                         preexec_fn=limited, capture_output=True, text=True, timeout=60,
                         env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(Path(__file__).parents[2])})
    assert run.returncode == 2, run.stderr
    assert "file descriptor limit (1024, RLIMIT_NOFILE) cannot hold" in run.stderr, run.stderr
    assert "LimitNOFILE=" in run.stderr and "pool.max_total" in run.stderr and "egress.max_connections" in run.stderr
    assert not sock.exists() and not (tmp_path / "data" / ".sandboxd.lock").exists()


def test_a_client_past_its_share_is_refused_naming_the_key_and_served_again_once_one_closes(tmp_path: Path) -> None:
    @serving(tmp_path, max_client_connections=3)
    async def _(h: Harness) -> None:
        held = [await h.connect() for _ in range(3)]
        for conn in held:
            assert (await conn.request("ping"))["result"] == {}
        over = await h.connect()
        refusal = await over.read()
        assert refusal["error"]["code"] == -32003, refusal
        assert "already holds 3 connections" in refusal["error"]["message"]
        assert "max_client_connections" in refusal["error"]["message"]
        held[0].writer.close()
        for _ in range(100):  # its descriptor is given back when the daemon sees the close
            if len(h.server.connections) == 2:
                break
            await asyncio.sleep(0.01)
        again = await h.connect()
        assert (await again.request("ping"))["result"] == {}


def test_a_sandbox_flooding_its_egress_socket_has_at_most_its_share_accepted(tmp_path: Path) -> None:
    """max_connections + EGRESS_REFUSING accepted (held, or being answered 503); the rest wait unaccepted
    in the listener's backlog, costing the daemon no descriptor, until one closes."""
    async def scenario() -> None:
        proxy, _ = make_proxy(max_connections=4, connect_rate=1000)
        session = proxy.session("a@b.c", "s", lambda: EgressCall(None, frozenset(), StandIns()))
        path = str(tmp_path / "egress.sock")
        listener = socket.socket(socket.AF_UNIX)
        listener.bind(path)
        listener.listen(256)
        listener.setblocking(False)
        serving_task = asyncio.ensure_future(session.serve(listener, lambda peer: True))
        writers = []
        for _ in range(30):  # none sends a request head: each is held until HEAD_TIMEOUT_S
            _reader, writer = await asyncio.open_unix_connection(path)
            writers.append(writer)
        await asyncio.sleep(0.3)
        assert session.connections == 4 + EGRESS_REFUSING
        for writer in writers[:3]:
            writer.close()
        await asyncio.sleep(0.3)
        assert session.connections == 4 + EGRESS_REFUSING  # three more accepted in their place
        serving_task.cancel()
        session.close()
        await asyncio.gather(serving_task, return_exceptions=True)
        for writer in writers:
            writer.close()
        listener.close()

    asyncio.run(scenario())
