"""Socket directories nobody can squat (issue 11, item 7), dangerous settings only by name and
no traffic between sandboxes (item 8). Real daemon, real Docker.

The network tests send traffic only between two containers on a bridge network on this
host (the listener's address is checked to lie in that network's subnet first); nothing
leaves the bridge.
"""

from __future__ import annotations

import ipaddress
import json
import os
import pwd
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
from pathlib import Path
from typing import Any

import pytest

from sandboxd.config import BRIDGE_NETWORK

from tests.e2e.conftest import REPO, Daemon, write_tool
from tests.e2e.hostile_harness import call, text_of, wait_until

pytestmark = pytest.mark.docker

ALICE, BOB = "alice@example.com", "bob@example.com"
needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="needs root to make directories of other uids")
SQUATTER_UID = 2_000_000_112  # the other local user: an id with no account here

# --- the socket directories ---------------------------------------------------------------------


@needs_root
def test_a_socket_directory_another_user_made_first_stops_start_up(make_daemon: Any) -> None:
    """The attack: another local user makes the daemon's socket directory (mode 0777) before
    it starts, as they can with the /tmp/sandboxd-UID fallback, to replace the socket and
    read what pi-bridge sends."""
    squat = Path(tempfile.gettempdir()) / f"sandboxd-{secrets.token_hex(4)}"
    squat.mkdir()
    try:
        os.chmod(squat, 0o777)
        os.chown(squat, SQUATTER_UID, SQUATTER_UID)
        daemon = make_daemon(start=False)
        daemon.socket = squat / "sandboxd.sock"
        log = _refused_start(daemon)
        assert (f"the socket's directory {squat} belongs to uid {SQUATTER_UID}, not to sandboxd's user "
                f"(uid {os.geteuid()}): its owner can replace the socket; remove it") in log
        assert os.listdir(squat) == []  # no socket and no .shims made in it

        # The same daemon starts once the directory is gone (so the refusal above was the check).
        shutil.rmtree(squat)
        daemon.start()
        info = squat.lstat()
        assert (info.st_uid, info.st_mode & 0o777) == (os.geteuid(), 0o755)
        daemon.stop()
    finally:
        shutil.rmtree(squat, ignore_errors=True)


def _refused_start(daemon: Daemon) -> str:
    with pytest.raises(AssertionError, match="daemon exited with") as info:
        daemon.start()
    return str(info.value)


def test_a_socket_directory_others_can_write_stops_start_up(make_daemon: Any) -> None:
    daemon = make_daemon(start=False)
    os.chmod(daemon.socket.parent, 0o777)
    log = _refused_start(daemon)
    assert f"the socket's directory {daemon.socket.parent} is writable by its group or by others (mode 0777)" in log
    assert f"chmod go-w {daemon.socket.parent}" in log
    assert not daemon.socket.exists()


@needs_root
def test_a_shims_directory_someone_else_made_stops_start_up(make_daemon: Any) -> None:
    """A squatter's `.shims` would let them plant the socket a sandbox's shim connects to."""
    daemon = make_daemon(start=False)
    shims = daemon.socket.parent / f"{daemon.socket.name}.shims"
    shims.mkdir(mode=0o700)
    os.chown(shims, SQUATTER_UID, SQUATTER_UID)
    log = _refused_start(daemon)
    assert f"the shim sockets' directory {shims} belongs to uid {SQUATTER_UID}" in log
    assert not daemon.socket.exists()


SHIM_KNOCKER = """
import { readdirSync } from 'node:fs';
import { connect } from 'node:net';

// Tries to talk to the shim socket of its own sandbox, as a second client.
export async function execute() {
  let listing: string[] | string;
  try { listing = readdirSync('/officer/run'); } catch (e) { listing = (e as NodeJS.ErrnoException).code ?? String(e); }
  const outcome = await new Promise<string>((resolve) => {
    const sock = connect('/officer/run/shim.sock');
    const timer = setTimeout(() => { sock.destroy(); resolve('no answer'); }, 3000);
    sock.once('connect', () => { clearTimeout(timer); sock.destroy(); resolve('connected'); });
    sock.once('error', (e) => { clearTimeout(timer); resolve((e as NodeJS.ErrnoException).code ?? String(e)); });
  });
  return { content: [{ type: 'text', text: JSON.stringify({ listing, outcome }) }] };
}
"""


def test_a_shim_socket_serves_only_its_own_shim(make_daemon: Any) -> None:
    """A tool that connects to its sandbox's shim socket as a second client finds nothing
    listening: the socket served the shim's one connection and is gone (the egress proxy's
    socket beside it stays: test_egress.py)."""
    daemon = make_daemon(start=False, config="pool:\n  min_idle: 0\n  max_per_user: 1\n")
    write_tool(daemon.data / "tools", "shim_knocker", SHIM_KNOCKER)
    daemon.start()
    with daemon.client() as client:
        for user in (ALICE, BOB):
            report = json.loads(text_of(call(client, user, "shim_knocker")))
            report["listing"].sort()
            assert report == {"listing": ["egress.sock", "hosts"], "outcome": "ENOENT"}, report  # egress: its way out
    shims = daemon.socket.parent / f"{daemon.socket.name}.shims"
    info = shims.lstat()
    assert (info.st_uid, info.st_mode & 0o777) == (os.geteuid(), 0o700)
    # Two sandboxes run, and no shim socket of theirs is left to connect to: only their egress sockets
    # (and the /etc/hosts each mounts).
    assert [sorted(os.listdir(shims / d)) for d in os.listdir(shims)] == [["egress.sock", "hosts"]] * 2


# --- dangerous settings ------------------------------------------------------------------------

HOST_ACCOUNT = next(p for p in pwd.getpwall() if p.pw_uid not in (0, os.geteuid()))


@pytest.mark.parametrize(("config", "env", "name"), [
    ("", {"SANDBOXD_SANDBOX_NETWORK": "host"}, "host_network"),
    ("", {"SANDBOXD_SANDBOX_NETWORK": "bridge"}, "shared_network"),
    ("sandbox:\n  cap_add: [SYS_ADMIN]\n", {}, "cap_add"),
    ("sandbox:\n  read_only_root: false\n", {}, "writable_root"),
    (f"sandbox:\n  user: '{HOST_ACCOUNT.pw_uid}:{HOST_ACCOUNT.pw_gid or 1}'\n", {}, "host_uid"),
    ("backend: process\n", {}, "unsandboxed"),
])
def test_a_dangerous_setting_stops_serve_until_it_is_named(make_daemon: Any, config: str, env: dict[str, str],
                                                         name: str) -> None:
    daemon = make_daemon(start=False, config=config, env=env)
    log = _refused_start(daemon)
    assert f"set allow_unsafe: [{name}] to accept it" in log
    assert not daemon.socket.exists()


def test_a_named_override_starts_the_daemon_with_that_setting(make_daemon: Any) -> None:
    daemon = make_daemon(config="allow_unsafe: [cap_add]\nsandbox:\n  cap_add: [CHOWN]\npool:\n  min_idle: 0\n")
    with daemon.client() as client:
        assert client.request("ping") is not None
    assert "UNSAFE_SETTINGS" in daemon.log() and "cap_add" in daemon.log()


def test_root_in_the_sandbox_has_no_override(make_daemon: Any) -> None:
    daemon = make_daemon(start=False, config="allow_unsafe: [host_uid]\nsandbox:\n  user: '0:0'\n")
    log = _refused_start(daemon)
    assert "runs tools as root (uid or gid 0), which is never allowed" in log


MARKER_WRITER = """
import { writeFileSync } from 'node:fs';

// Unsandboxed, this lands on the host: the proof that it ran outside a sandbox.
export async function execute(_id: string, params: { path: string }) {
  writeFileSync(params.path, 'ran on the host');
  return { content: [{ type: 'text', text: 'wrote it' }] };
}
"""


def test_run_without_docker_stops_instead_of_running_the_tool_unsandboxed(tmp_path: Path) -> None:
    write_tool(tmp_path, "marker", MARKER_WRITER, inputs="  path:\n    type: string\n    description: Where.\n")
    marker = tmp_path / "ran-unsandboxed"
    env = {k: v for k, v in os.environ.items() if not k.startswith("SANDBOXD_")}
    env.update(SANDBOXD_CONFIG=os.devnull, SANDBOXD_DATA_PATH=str(tmp_path / "data"),
               SANDBOXD_SANDBOX_NETWORK="none", SANDBOXD_SANDBOX_DOCKER_HOST="unix:///nonexistent/docker.sock",
               PYTHONPATH=str(REPO))
    ran = subprocess.run([sys.executable, "-m", "sandboxd", "run", "marker", "--arg", f"path={marker}"],
                         cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60, check=False)
    assert ran.returncode == 2, ran.stderr
    assert "the Docker engine is not reachable" in ran.stderr and "pass --backend process" in ran.stderr
    assert not marker.exists() and "UNSANDBOXED (" not in ran.stderr


# --- no traffic between sandboxes ---------------------------------------------------------------

LISTENER = """
import { createServer, connect } from 'node:net';
import { networkInterfaces } from 'node:os';

type Block = { type: string; text: string };
// Listens on 0.0.0.0, says where, and reports whether anyone but itself connected.
export async function execute(_id: string, params: { port: number; wait_ms: number }, _signal?: AbortSignal,
  onUpdate?: (p: { content: Block[] }) => void) {
  const addresses = Object.values(networkInterfaces()).flat()
    .filter((a) => a && a.family === 'IPv4' && !a.internal).map((a) => a!.address);
  let strangers = 0;
  const server = createServer((sock) => {
    if (!addresses.includes(sock.remoteAddress?.replace('::ffff:', '') ?? '')) strangers++;
    sock.destroy();
  });
  await new Promise<void>((resolve, reject) => { server.once('error', reject); server.listen(params.port, '0.0.0.0', resolve); });
  // It really listens on that address: reach it from inside this sandbox.
  const selfReach = await new Promise<boolean>((resolve) => {
    const sock = connect({ host: addresses[0], port: params.port });
    sock.once('connect', () => { sock.destroy(); resolve(true); });
    sock.once('error', () => resolve(false));
  });
  onUpdate?.({ content: [{ type: 'text', text: JSON.stringify({ addresses, selfReach }) }] });
  const deadline = Date.now() + params.wait_ms;
  while (strangers === 0 && Date.now() < deadline) await new Promise((r) => setTimeout(r, 50));
  server.close();
  return { content: [{ type: 'text', text: JSON.stringify({ strangers }) }] };
}
"""

KNOCKER = """
import { connect } from 'node:net';

export async function execute(_id: string, params: { host: string; port: number; timeout_ms: number }) {
  const outcome = await new Promise<string>((resolve) => {
    const sock = connect({ host: params.host, port: params.port });
    const timer = setTimeout(() => { sock.destroy(); resolve('timeout'); }, params.timeout_ms);
    sock.once('connect', () => { clearTimeout(timer); sock.destroy(); resolve('connected'); });
    sock.once('error', (e) => { clearTimeout(timer); resolve((e as NodeJS.ErrnoException).code ?? String(e)); });
  });
  return { content: [{ type: 'text', text: outcome }] };
}
"""
PORT = 7311
# A SYN across a local bridge is answered in well under a millisecond: 2 s of silence is a drop.
KNOCK_TIMEOUT_MS = 2000
# The listener waits this long for the knock; it ends sooner once someone connects.
LISTEN_MS = KNOCK_TIMEOUT_MS + 6000


def network_daemon(make_daemon: Any, network: str, config: str = "") -> Daemon:
    daemon = make_daemon(start=False, env={"SANDBOXD_SANDBOX_NETWORK": network},
                         config=config + "pool:\n  min_idle: 0\n  max_per_user: 1\n")
    write_tool(daemon.data / "tools", "listener", LISTENER,
               inputs="  port:\n    type: number\n    description: Port.\n"
                      "  wait_ms:\n    type: number\n    description: How long to wait.\n")
    write_tool(daemon.data / "tools", "knocker", KNOCKER,
               inputs="  host:\n    type: string\n    description: Address.\n"
                      "  port:\n    type: number\n    description: Port.\n"
                      "  timeout_ms:\n    type: number\n    description: How long to try.\n")
    return daemon.start()


def knock(daemon: Daemon, docker_api: Any, network: str) -> tuple[str, dict[str, Any]]:
    """Alice's tool listens; Bob's tool, in his own sandbox, connects to Alice's address."""
    announced: list[dict[str, Any]] = []
    outcome: dict[str, Any] = {}
    with daemon.client() as client:  # Bob's sandbox warm first, so his knock comes soon after Alice listens
        assert text_of(call(client, BOB, "knocker", {"host": "127.0.0.1", "port": PORT, "timeout_ms": 1000})) \
            == "ECONNREFUSED"

    def listen() -> None:
        with daemon.client() as client:
            outcome["listener"] = client.request(
                "tools/call", {"user": ALICE, "name": "listener",
                               "arguments": {"port": PORT, "wait_ms": LISTEN_MS}},
                on_progress=lambda p: announced.append(json.loads(p["content"][0]["text"])))

    thread = threading.Thread(target=listen, daemon=True)
    thread.start()
    try:
        wait_until(lambda: announced or not thread.is_alive(), 60, "the listener's address")
        assert announced, f"the listener never said where it listens: {outcome}"
        address = announced[0]["addresses"][0]
        assert announced[0]["selfReach"] is True, announced
        # Only ever a container on this host's bridge: nothing leaves it. (The daemon made
        # its network for the listener's sandbox, if it was not there.)
        subnets = [ipaddress.ip_network(c["Subnet"]) for c in docker_api.api.inspect_network(network)["IPAM"]["Config"]]
        assert any(ipaddress.ip_address(address) in subnet for subnet in subnets), (address, subnets)
        with daemon.client() as client:
            reached = text_of(call(client, BOB, "knocker",
                                   {"host": address, "port": PORT, "timeout_ms": KNOCK_TIMEOUT_MS}))
    finally:
        thread.join(60)
    return reached, json.loads(text_of(outcome["listener"]))


def test_sandboxes_of_two_users_cannot_reach_each_other(make_daemon: Any, docker_api: Any) -> None:
    """On the daemon's bridge (direct routes, for operators who accept them): no traffic between sandboxes.
    (On the default network `none` there is no address to knock on at all.)"""
    daemon = network_daemon(make_daemon, BRIDGE_NETWORK, config="allow_unsafe: [direct_network]\n")
    reached, listener = knock(daemon, docker_api, BRIDGE_NETWORK)
    assert reached == "timeout" and listener == {"strangers": 0}, (reached, listener)
    network = docker_api.api.inspect_network(BRIDGE_NETWORK)
    assert network["Options"]["com.docker.network.bridge.enable_icc"] == "false"
    assert network["Labels"]["org.sandboxd.managed"] == "1"


def test_the_same_knock_gets_through_on_a_network_that_lets_containers_talk(make_daemon: Any, docker_api: Any) -> None:
    """The control: on a bridge with inter-container traffic on (what `bridge` is), the
    check above sees the connection, so its "timeout" means blocked, not a broken probe."""
    name = f"sbd-icc-test-{secrets.token_hex(4)}"
    docker_api.api.create_network(name, driver="bridge", labels={"org.sandboxd.test": "1"})
    try:
        daemon = network_daemon(make_daemon, name, config="allow_unsafe: [shared_network]\n")
        reached, listener = knock(daemon, docker_api, name)
        assert reached == "connected" and listener == {"strangers": 1}, (reached, listener)
        daemon.stop()
        daemon.remove_leftovers(docker_api)
    finally:
        docker_api.api.remove_network(name)
