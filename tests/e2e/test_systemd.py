"""sandboxd under a real systemd: the units, `make install` and docs/install.md, end to end.

A container boots systemd as PID 1 (tests/e2e/systemd/build-image.sh: Debian bookworm
from debootstrap, no registry), sandboxd is installed in it with `make install` as
docs/install.md says, and the service drives the host's Docker engine through its socket.

Paths the engine must see: sandboxes bind-mount the data path (/var/lib/sandboxd) and their
shim socket directory (/run/sandboxd/sandboxd.sock.shims), and the engine resolves those
paths on the host. So both are host directories bind-mounted into the container at the same
path, and the default `transport: socket` is what runs (not `attach`, which would leave the
shim directory untested). Because those are the real paths, the test refuses a host that
has them already (an installed sandboxd) and removes them afterwards.

Python packages: wheels of sandboxd's dependencies are built on the host (with the host's
pip and its registry settings) and `make install` runs with PIP_NO_INDEX/PIP_FIND_LINKS
pointing at them. The container has no network at all (`--network none`): nothing in it
depends on reaching a registry, and no traffic leaves it.

The tests run in file order against one installed machine: the first enables sandboxd.socket
(and must run for any other to), the last stops the service and the socket.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import shlex
import shutil
import subprocess
import sys
import time
import uuid
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Callable, Iterator

import pytest

from sandboxd.config import RUNNER_IMAGE, load_config
from sandboxd.server.server import instance_id
from tests.e2e.conftest import REPO
from tests.loopfs import loop_devices_usable, loop_filesystem

pytestmark = [pytest.mark.systemd, pytest.mark.docker]

HERE = Path(__file__).resolve().parent / "systemd"
SOCKET = "/run/sandboxd/sandboxd.sock"
DATA_PATH = Path("/var/lib/sandboxd")
# Host paths the container shares at the same path (see the module docstring).
HOST_DIRS = (Path("/run/sandboxd"), DATA_PATH)
# Names the container of the run that made HOST_DIRS, so an interrupted run's are recognised.
MARKER = Path("/run/sandboxd-systemd-e2e")
# Held by the run using HOST_DIRS: a second run on this host waits for it.
LOCK = Path("/run/sandboxd-systemd-e2e.lock")
RPC = "/usr/local/lib/sandboxd-e2e-rpc.py"
MEMBER, OUTSIDER = "pi-bridge", "outsider"
A = "alice@example.com"
PING = {"jsonrpc": "2.0", "id": 1, "method": "ping"}
PONG = {"jsonrpc": "2.0", "id": 1, "result": {}}
STATUS = {"jsonrpc": "2.0", "id": 2, "method": "sandbox/status"}
# Left out of the copy of the checkout: large, rebuilt, or not what `make install` reads.
COPY_EXCLUDES = (".git", ".venv", "build", ".sandboxd", "bench-results", "clients/pi/node_modules",
                 "clients/typescript/node_modules")


def need(ok: bool, why: str) -> None:
    """A missing prerequisite: a skip on a developer's machine, a failure in CI (never a silent skip there)."""
    if ok:
        return
    if os.environ.get("CI"):
        pytest.fail(f"{why} (CI must run the systemd test; .ci/run prepares the machine for it)")
    pytest.skip(why)


def run(args: list[str], *, timeout: float = 120, check: bool = True, **kwargs: Any) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(args, capture_output=True, text=True, errors="replace", timeout=timeout, **kwargs)
    if check and proc.returncode != 0:
        raise AssertionError(f"{shlex.join(args)} exited {proc.returncode}:\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}")
    return proc


def parse_time(value: str) -> datetime:
    """A systemctl --timestamp=us+utc value ("Tue 2026-12-01 12:04:34.391891 UTC") or a log's ISO timestamp."""
    if value.endswith(" UTC"):
        return datetime.strptime(value, "%a %Y-%m-%d %H:%M:%S.%f UTC").replace(tzinfo=timezone.utc)
    return datetime.fromisoformat(value)


class Machine:
    """The systemd container: commands, systemctl, the journal, clients as its users."""

    def __init__(self, name: str) -> None:
        self.name = name

    def sh(self, script: str, *, timeout: float = 120, check: bool = True, input: str | None = None
           ) -> subprocess.CompletedProcess[str]:
        proc = run(["docker", "exec", "-i", self.name, "bash", "-c", script], timeout=timeout, check=False,
                   input=input or "")
        if check and proc.returncode != 0:
            raise AssertionError(f"in the container, `{script}` exited {proc.returncode}:\n{proc.stdout[-4000:]}\n"
                                 f"{proc.stderr[-4000:]}\n--- journal of sandboxd ---\n{self.journal_text()}")
        return proc

    def show(self, unit: str, *props: str) -> dict[str, str]:
        out = self.sh(f"systemctl show --timestamp=us+utc {unit} " + " ".join(f"-p {p}" for p in props)).stdout
        return dict(line.split("=", 1) for line in out.splitlines() if "=" in line)

    def active(self, unit: str) -> str:
        return self.sh(f"systemctl is-active {unit}", check=False).stdout.strip()

    def rpc(self, user: str, *requests: dict[str, Any], timeout: float = 120) -> list[dict[str, Any]]:
        """Each request's answer, sent on one connection by ``user`` (a connect error is one {"connect_error": ...})."""
        lines = "".join(json.dumps(r) + "\n" for r in requests)  # on stdin: a secret must not be in any argv
        proc = self.sh(f"runuser -u {user} -- python3 {RPC} {SOCKET}", timeout=timeout, check=False, input=lines)
        if proc.returncode not in (0, 3):
            raise AssertionError(f"rpc as {user} failed ({proc.returncode}):\n{proc.stderr}\n{self.journal_text()}")
        return [json.loads(line) for line in proc.stdout.splitlines()]

    def status(self) -> dict[str, Any]:
        return self.rpc(MEMBER, STATUS)[0]["result"]

    def journal(self) -> list[dict[str, Any]]:
        """Every journal entry about the units: the daemon's output and systemd's messages."""
        out = self.sh("journalctl --no-pager -o json -u sandboxd.service -u sandboxd.socket").stdout
        return [json.loads(line) for line in out.splitlines()]

    def daemon_output(self) -> list[dict[str, Any]]:
        """The entries of what the daemon itself wrote (its stdout/stderr), not what systemd says about it."""
        return [e for e in self.journal() if e.get("_SYSTEMD_UNIT") == "sandboxd.service" and e.get("_TRANSPORT") == "stdout"]

    def daemon_lines(self) -> list[str]:
        return [e["MESSAGE"] for e in self.daemon_output()]

    def events(self, name: str) -> list[dict[str, Any]]:
        found = []
        for line in self.daemon_lines():
            try:
                event = json.loads(line)
            except (TypeError, ValueError):
                continue
            if isinstance(event, dict) and event.get("event") == name:
                found.append(event)
        return found

    def journal_text(self) -> str:
        proc = run(["docker", "exec", self.name, "journalctl", "--no-pager", "-o", "cat",
                    "-u", "sandboxd.service", "-u", "sandboxd.socket"], check=False)
        return proc.stdout[-8000:]

    def wait_for(self, condition: Callable[[], Any], what: str, timeout: float = 60) -> Any:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            value = condition()
            if value:
                return value
            time.sleep(0.1)
        raise AssertionError(f"{what} did not happen within {timeout} s:\n{self.journal_text()}")


def instance_containers(docker_api: Any) -> list[dict[str, Any]]:
    """The sandboxes of the data path /var/lib/sandboxd, as the host's engine lists them."""
    instance = instance_id(load_config(overrides={"data_path": DATA_PATH, "socket": Path(SOCKET)}, environ={}))
    return docker_api.api.containers(all=True, filters={"label": [f"org.sandboxd.instance={instance}"]})


def remove_instance_containers(docker_api: Any) -> None:
    for container in instance_containers(docker_api):
        docker_api.api.remove_container(container["Id"], force=True)


def hold_the_host(timeout: float = 600) -> int:
    """The lock on HOST_DIRS (an fd: the kernel drops it if this process dies)."""
    fd = os.open(LOCK, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    deadline = time.monotonic() + timeout
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return fd
        except BlockingIOError:
            if time.monotonic() > deadline:
                os.close(fd)
                need(False, f"another run of the systemd test has held {LOCK} for {timeout:.0f} s")
            time.sleep(1)


def free_host_dirs(docker_api: Any) -> None:
    """Make HOST_DIRS ours: remove what an interrupted earlier run left; refuse a host that has them otherwise."""
    if MARKER.exists():
        run(["docker", "rm", "-f", MARKER.read_text().strip()], check=False)
        remove_instance_containers(docker_api)
        for path in HOST_DIRS:
            shutil.rmtree(path, ignore_errors=True)
        MARKER.unlink()
    taken = [str(p) for p in HOST_DIRS if p.exists()]
    need(not taken, f"this host has {' and '.join(taken)} (an installed sandboxd?); the systemd test shares those "
                    "paths with its container and would take them over: run it on a host without them")


def dependency_wheels() -> Path:
    """Wheels of sandboxd's dependencies and build backend, made once per dependency list."""
    import tomllib

    project = tomllib.loads((REPO / "pyproject.toml").read_text())
    requirements = sorted(project["project"]["dependencies"] + project["build-system"]["requires"])
    digest = hashlib.sha256("\n".join(requirements).encode()).hexdigest()[:12]
    wheels = REPO / "build" / f"systemd-e2e-wheels-{digest}"
    if not wheels.is_dir():
        partial = wheels.with_name(wheels.name + f".partial-{os.getpid()}")
        run([sys.executable, "-m", "pip", "wheel", "-q", "-w", str(partial), *requirements], timeout=600)
        partial.rename(wheels)
    return wheels


def copy_checkout(name: str) -> None:
    """The checkout as it is (uncommitted changes included, like every other test), into /src."""
    excludes = [f"--exclude=./{path}" for path in COPY_EXCLUDES] + ["--exclude=__pycache__", "--exclude=*.egg-info"]
    tar = subprocess.Popen(["tar", "-C", str(REPO), "-c", *excludes, "."], stdout=subprocess.PIPE)
    run(["docker", "exec", "-i", name, "sh", "-c", "mkdir -p /src && tar -C /src -x"], stdin=tar.stdout)
    assert tar.wait() == 0


@pytest.fixture(scope="module")
def machine(docker_api: Any) -> Iterator[Machine]:
    need(os.geteuid() == 0, "the systemd test needs root (debootstrap, and the host paths it shares)")
    node, docker_cli = shutil.which("node"), shutil.which("docker")
    need(node is not None and docker_cli is not None, "the systemd test needs node and the docker CLI on the host")
    image_script = HERE / "build-image.sh"
    tag = run(["bash", str(image_script), "--print-tag"]).stdout.strip()
    if run(["docker", "image", "inspect", tag], check=False).returncode != 0:
        need(shutil.which("debootstrap") is not None,
             "debootstrap is missing, and the systemd test builds its image with it (bash scripts/ensure-docker.sh installs it)")
        started = time.monotonic()
        run(["bash", str(image_script)], timeout=900)
        print(f"systemd image {tag} built in {time.monotonic() - started:.0f} s")
    # `make install` runs `make image`, which would `npm ci` the shim's dependencies if they did not
    # match its lock file; the container has neither npm nor a network. `make test` runs `make image` first.
    shim = REPO / "images" / "node" / "shim"
    stamp = shim / "node_modules" / ".sandboxd-lock-sha256"
    wanted = hashlib.sha256((shim / "package.json").read_bytes() + (shim / "package-lock.json").read_bytes()).hexdigest()
    need(stamp.is_file() and stamp.read_text().strip() == wanted,
         "the shim's node_modules do not match its package-lock.json: run `make image` first")
    wheels = dependency_wheels()

    name = f"sandboxd-systemd-e2e-{uuid.uuid4().hex[:8]}"
    machine = Machine(name)
    lock = hold_the_host()
    quota_fs = contextlib.ExitStack()
    try:
        free_host_dirs(docker_api)
        MARKER.write_text(name)
        for path in HOST_DIRS:
            path.mkdir(parents=True)
        # The data path on btrfs with quota, as docs/install.md sets it up: the helper's hard quota.
        if loop_devices_usable("btrfs") is None:
            quota_fs.enter_context(loop_filesystem(DATA_PATH, "btrfs", 1024))
        run(["docker", "run", "-d", "--name", name, "--network", "none",
             # systemd as PID 1 on this engine (docs: ../shared/notes/docker-here.md)
             "--cap-add", "SYS_ADMIN", "--security-opt", "seccomp=unconfined", "--security-opt", "apparmor=unconfined",
             "--cgroupns=host", "-v", "/sys/fs/cgroup:/sys/fs/cgroup:rw", "--tmpfs", "/run", "--tmpfs", "/run/lock",
             # the host's engine, and the paths it must see as the service does
             "-v", "/run/docker.sock:/run/docker.sock", *[f"-v{p}:{p}" for p in HOST_DIRS],
             # what `make install` runs besides the image's packages: `make image` uses both
             "-v", f"{os.path.realpath(docker_cli)}:/usr/local/bin/docker:ro",
             "-v", f"{os.path.realpath(node)}:/usr/local/bin/node:ro",
             "-v", f"{wheels}:/wheels:ro", tag])
        # `--wait` needs PID 1's bus, which is not there in the first moments.
        booted = machine.wait_for(lambda: machine.sh("systemctl is-system-running --wait", check=False).stdout.strip(),
                                  "systemd's boot in the container")
        assert booted == "running", f"systemd in the container is {booted}:\n" + machine.sh("systemctl --failed").stdout
        copy_checkout(name)
        run(["docker", "cp", str(HERE / "rpc.py"), f"{name}:{RPC}"])
        # What installing Debian's docker.io does on a real host: a docker group owning the socket.
        gid = os.stat("/run/docker.sock").st_gid
        machine.sh(f"groupadd --system --non-unique --gid {gid} docker")
        started = time.monotonic()
        machine.sh("cd /src && PIP_NO_INDEX=1 PIP_FIND_LINKS=/wheels make install", timeout=600)
        print(f"make install took {time.monotonic() - started:.0f} s")
        machine.sh(f"useradd --create-home --groups sandboxd {MEMBER} && useradd --create-home {OUTSIDER}")
        machine.sh("systemctl enable --now sandboxd-quota.socket")  # docs/install.md, "Disk quotas"
        yield machine
    finally:
        if MARKER.exists() and MARKER.read_text() == name:  # HOST_DIRS are this run's: undo all of it
            journal = run(["docker", "exec", name, "journalctl", "--no-pager", "-o", "short-precise"], check=False)
            (REPO / "build").mkdir(exist_ok=True)
            (REPO / "build" / "systemd-e2e-journal.txt").write_text(journal.stdout)  # for a post-mortem
            run(["docker", "exec", name, "systemctl", "stop", "sandboxd.service", "sandboxd.socket"], check=False)
            run(["docker", "rm", "-f", name], check=False)
            remove_instance_containers(docker_api)
            quota_fs.close()  # unmounted before its mount point goes
            for path in HOST_DIRS:
                shutil.rmtree(path, ignore_errors=True)
            MARKER.unlink()
        quota_fs.close()
        os.close(lock)


def call(tool: str, arguments: dict[str, Any], env: dict[str, str] | None = None, id: int = 7) -> dict[str, Any]:
    params: dict[str, Any] = {"user": A, "name": tool, "arguments": arguments}
    if env:
        params["env"] = env
    return {"jsonrpc": "2.0", "id": id, "method": "tools/call", "params": params}


def test_the_first_connection_starts_the_service_which_is_active_only_once_ready(machine: Machine) -> None:
    machine.sh("systemctl enable --now sandboxd.socket")
    assert machine.active("sandboxd.socket") == "active"
    assert machine.active("sandboxd.service") == "inactive"  # nothing has connected yet

    assert machine.rpc(MEMBER, PING) == [PONG]  # queued in systemd's socket until the daemon was ready
    assert machine.active("sandboxd.service") == "active"
    listening = machine.events("listening")
    assert len(listening) == 1 and listening[0]["activated"] is True and listening[0]["socket"] == SOCKET

    # Type=notify: active once READY=1 came, after the socket listened; a Type=simple unit is
    # active as soon as the process exists, before the daemon has even imported its modules.
    unit = machine.show("sandboxd.service", "ExecMainStartTimestamp", "ActiveEnterTimestamp", "StatusText")
    started, ready = parse_time(unit["ExecMainStartTimestamp"]), parse_time(unit["ActiveEnterTimestamp"])
    assert started < parse_time(listening[0]["timestamp"]) < ready, unit
    assert unit["StatusText"].startswith(f"serving on {SOCKET}: ")
    shown = machine.sh("systemctl status --no-pager sandboxd.service").stdout
    assert f'Status: "serving on {SOCKET}: ' in shown, shown


def test_the_unit_gives_the_daemon_the_descriptors_its_budget_needs(machine: Machine) -> None:
    """LimitNOFILE= sets both limits: under SystemCallFilter=~@resources the daemon cannot raise its own,
    and systemd's default soft limit (1024) cannot hold the default configuration (service/fds.py)."""
    assert machine.rpc(MEMBER, PING) == [PONG]
    assert machine.show("sandboxd.service", "LimitNOFILE", "LimitNOFILESoft") == {
        "LimitNOFILE": "65536", "LimitNOFILESoft": "65536"}
    # systemd cannot give more than its own hard limit (this container's: the engine's default, 20000 here).
    ceiling = int(machine.sh("awk '/Max open files/ {print $5}' /proc/1/limits").stdout)
    budget = machine.events("fd_budget")[-1]
    assert budget["soft_at_start"] == budget["hard"] == budget["limit"] == min(65536, ceiling), budget
    # the daemon's 256, the egress relay's 32 pipes (64 fds), 32 sandboxes of 72, 8 for refusing; a quarter each
    assert budget["per_client"] == (budget["limit"] - 256 - 64 - 32 * 72 - 8) // 4, budget


def test_a_member_of_the_group_runs_a_tool_in_a_real_sandbox_and_an_outsider_is_refused(
        machine: Machine, docker_api: Any) -> None:
    answer = machine.rpc(MEMBER, call("hello", {"name": "systemd"}))[0]
    assert answer["result"]["status"] == "ok", answer
    assert answer["result"]["content"] == [{"type": "text", "text": "Hello, systemd!"}]
    assert machine.status()["transport"] == "socket"

    sandbox = machine.events("call")[-1]["sandbox"]
    ran = [c for c in instance_containers(docker_api) if c["Id"].startswith(sandbox)]
    assert len(ran) == 1 and ran[0]["Image"] == RUNNER_IMAGE, instance_containers(docker_api)
    # The shim dialled in through the shared directory, which also holds the sandbox's /etc/hosts.
    shim_mounts = {m["Destination"] for m in ran[0]["Mounts"] if m["Source"].startswith(f"{SOCKET}.shims/")}
    assert shim_mounts == {"/officer/run", "/etc/hosts"}, ran[0]["Mounts"]

    # The socket is 0660, group sandboxd (sandboxd.socket): anyone else cannot even connect.
    assert machine.rpc(OUTSIDER, PING)[0]["connect_error"] == "EACCES"
    assert machine.sh(f"stat -c '%a %G' {SOCKET}").stdout.split() == ["660", "sandboxd"]


def test_the_unprivileged_daemon_gets_its_users_folders_under_the_quota_from_the_helper(machine: Machine) -> None:
    """After the calls above: alice's folders were made by sandboxd-quota@.service, as btrfs subvolumes in a
    qgroup limited to storage.quota_bytes, and handed to the sandboxd user; the daemon itself never was root."""
    need(loop_devices_usable("btrfs") is None, f"no btrfs here: {loop_devices_usable('btrfs')}")
    enforcement = {e["area"]: (e["enforcement"], e["how"]) for e in machine.events("storage_enforcement")}
    assert set(enforcement) == {"data", "email"}, enforcement
    for mode, how in enforcement.values():
        assert mode == "hard" and "sandboxd-quota helper" in how, enforcement
    daemon_uid = int(machine.sh("id -u sandboxd").stdout)
    assert machine.show("sandboxd.service", "User")["User"] == "sandboxd"
    limits = {}
    for line in run(["btrfs", "qgroup", "show", "-re", "--raw", str(DATA_PATH)]).stdout.splitlines():
        fields = line.split()
        if fields and fields[0].startswith("1/"):
            limits[fields[0]] = fields[3]
    for folder in (DATA_PATH / A, DATA_PATH / "email" / A):
        info = os.stat(folder)
        assert info.st_ino == 256 and info.st_uid == daemon_uid, folder  # a subvolume, the daemon's
    group = "1/" + run(["btrfs", "inspect-internal", "rootid", str(DATA_PATH / A)]).stdout.strip()
    assert limits.get(group) == str(load_config(environ={}).storage.quota_bytes), limits
    helper = machine.sh("journalctl --no-pager -o cat -u 'sandboxd-quota@*'").stdout
    assert "disk quota helper" in helper, helper  # systemd started it for the requests (Accept=yes)
    # The helper's socket is the daemon user's own (0600): a member of the sandboxd group cannot even
    # connect, so it cannot hold one of the 8 instances (issue 44, item 10).
    quota_socket = str(load_config(environ={}).storage.helper_socket)
    assert machine.sh(f"stat -c '%a %U' {quota_socket}").stdout.split() == ["600", "sandboxd"]
    member = machine.sh(f"runuser -u {MEMBER} -- python3 {RPC} {quota_socket}", check=False, input='{"op": "check"}\n')
    assert json.loads(member.stdout.splitlines()[0])["connect_error"] == "EACCES", member.stdout
    row = machine.status()["storage"]["users"][A]
    assert row["bytesEnforcedByKernel"] is True


def test_reload_applies_a_pool_change_live(machine: Machine) -> None:
    pid = machine.show("sandboxd.service", "MainPID")["MainPID"]
    assert machine.status()["limits"]["maxPerUser"] == 4
    machine.sh("sed -i 's/^  max_per_user: 4 */  max_per_user: 3 /' /etc/sandboxd/config.yaml"
               " && grep -q '^  max_per_user: 3 ' /etc/sandboxd/config.yaml")
    machine.sh("systemctl reload sandboxd.service")
    machine.wait_for(lambda: machine.status()["limits"]["maxPerUser"] == 3, "the reload's pool change")
    assert "pool.max_per_user" in machine.events("config_reloaded")[-1]["applied"]
    assert machine.show("sandboxd.service", "MainPID")["MainPID"] == pid  # the same process: live
    assert machine.active("sandboxd.service") == "active"


def test_the_daemons_egress_proxy_reaches_a_site_off_the_loopback(machine: Machine) -> None:
    """Sandboxes have no network; the daemon's egress proxy connects for them, so the unit's
    IP rules bind every tool's web traffic. The site has a non-loopback address: a documentation
    address (RFC 5737) on the loopback device of the container's own network namespace. The
    request goes to a running sandbox's egress.sock as its uid, as that sandbox's shim sends it."""
    need(shutil.which("nsenter") is not None and shutil.which("ip") is not None,
         "the systemd test needs nsenter and ip on the host (util-linux, iproute2) to give its site an address")
    site = "198.51.100.7"
    pid = run(["docker", "inspect", "-f", "{{.State.Pid}}", machine.name]).stdout.strip()
    run(["nsenter", "-t", pid, "-n", "ip", "address", "add", f"{site}/32", "dev", "lo"])
    machine.sh("mkdir -p /srv/site && echo 'reached through the egress proxy' > /srv/site/page.txt")
    run(["docker", "exec", "-d", machine.name, "python3", "-m", "http.server", "--bind", site, "--directory", "/srv/site", "8080"])
    url = f"http://{site}:8080/page.txt"
    machine.wait_for(lambda: machine.sh(f"python3 -c 'import urllib.request; urllib.request.urlopen(\"{url}\", timeout=5)'",
                                        check=False).returncode == 0, "the site in the container")
    machine.sh(f"""sed -i 's/^  allow: \\[\\]/  allow: ["{site}:8080"]/' /etc/sandboxd/config.yaml"""
               f" && grep -q '{site}:8080' /etc/sandboxd/config.yaml && systemctl restart sandboxd.service")

    # The whole way: a tool's fetch in a sandbox, through the shim's egress forwarding.
    answer = machine.rpc(MEMBER, call("web_fetch", {"url": url, "timeout_seconds": 60}))[0]
    assert answer["result"]["status"] == "ok", answer
    assert "reached through the egress proxy" in json.dumps(answer["result"]), answer
    # And straight into a sandbox's egress.sock. Only web_fetch has run since the restart: a sandbox keeps its
    # last tool's permissions.network between calls, and web_fetch's ("*") leaves the policy to decide.
    uid = 2000000000  # sandbox.user auto
    got = json.loads(machine.sh(f"python3 {RPC} --egress {url} {uid}", timeout=180).stdout)
    assert got == {"status": "HTTP/1.0 200 OK", "body": "reached through the egress proxy\n"}, got
    decisions = [e for e in machine.events("egress") if e.get("host") == site]
    assert decisions and all(e["decision"] == "allowed" for e in decisions), machine.events("egress")


def test_restart_keeps_the_socket_and_loses_no_queued_connection(machine: Machine) -> None:
    pid = machine.show("sandboxd.service", "MainPID")["MainPID"]
    inode = machine.sh(f"stat -c %i {SOCKET}").stdout
    count = 120
    # A client connecting every 50 ms for 6 s, each on its own connection, all through the restart.
    pinger = subprocess.Popen(["docker", "exec", machine.name, "runuser", "-u", MEMBER, "--", "python3", RPC,
                               SOCKET, "--pings", str(count), "--every", "0.05"], stdout=subprocess.PIPE, text=True)
    assert pinger.stdout is not None
    results = [json.loads(pinger.stdout.readline())]  # the first answer: the pings are under way
    machine.sh("systemctl restart sandboxd.service")
    results += [json.loads(line) for line in pinger.stdout]
    assert pinger.wait(timeout=120) == 0
    lost = [r for r in results if r.get("answer") != PONG]
    assert len(results) == count and not lost, lost

    assert machine.show("sandboxd.service", "MainPID")["MainPID"] != pid
    assert machine.sh(f"stat -c %i {SOCKET}").stdout == inode  # systemd's socket, never re-made
    # Some connections arrived while no daemon was accepting: from the old one's shutdown to
    # the new one listening. They waited in the socket's queue and were answered.
    down = parse_time(machine.events("shutting_down")[-1]["timestamp"]).timestamp()
    up = parse_time(machine.events("listening")[-1]["timestamp"]).timestamp()
    assert down < up
    assert [r for r in results if down <= r["connected"] <= up], (down, up, [r["connected"] for r in results])


def test_the_watchdog_restarts_a_daemon_whose_loop_is_stopped(machine: Machine) -> None:
    assert machine.show("sandboxd.service", "WatchdogUSec")["WatchdogUSec"] == "30s"  # on as shipped
    # 4 s instead of 30 s to keep the test short; the daemon pings every WatchdogSec/2 (at most 5 s).
    machine.sh("mkdir -p /etc/systemd/system/sandboxd.service.d && printf '[Service]\\nWatchdogSec=4s\\n'"
               " > /etc/systemd/system/sandboxd.service.d/watchdog.conf"
               " && systemctl daemon-reload && systemctl restart sandboxd.service")
    try:
        unit = machine.show("sandboxd.service", "MainPID", "NRestarts", "WatchdogUSec")
        assert unit["WatchdogUSec"] == "4s"
        # A daemon that did not feed the watchdog would be killed within 4 s: staying up
        # through 2.5 periods is the evidence that a healthy loop pings.
        time.sleep(10)
        assert machine.show("sandboxd.service", "MainPID", "NRestarts") == {k: unit[k] for k in ("MainPID", "NRestarts")}

        machine.sh(f"kill -STOP {unit['MainPID']}")
        machine.wait_for(lambda: machine.show("sandboxd.service", "NRestarts")["NRestarts"] == str(int(unit["NRestarts"]) + 1)
                         and machine.active("sandboxd.service") == "active", "the restart after the watchdog fired")
        assert machine.show("sandboxd.service", "MainPID")["MainPID"] != unit["MainPID"]
        said = [e["MESSAGE"] for e in machine.journal() if "Watchdog timeout" in str(e.get("MESSAGE"))]
        assert said, machine.journal_text()
        assert machine.rpc(MEMBER, PING) == [PONG]
    finally:
        machine.sh("rm -rf /etc/systemd/system/sandboxd.service.d && systemctl daemon-reload")


def test_a_config_that_does_not_load_fails_the_unit_and_its_clients_get_an_error(machine: Machine) -> None:
    """No restart mends a bad config: the unit fails instead of restarting every RestartSec
    for ever while the clients queued in the socket wait for a daemon that never comes."""
    config = "/etc/sandboxd/config.yaml"
    machine.sh(f"cp {config} /root/config.yaml.good && sed -i -E 's/^  max_per_user: [0-9]+/  max_per_user: 0/' {config}")
    try:
        assert machine.sh("systemctl restart sandboxd.service", check=False).returncode != 0
        assert machine.active("sandboxd.service") == "failed"  # not "activating": no auto-restart
        assert [e for e in machine.journal() if "pool.max_per_user" in str(e.get("MESSAGE"))]  # the reason, in the journal
        # The client's connection starts the daemon again, which fails again, until systemd's
        # start limit stops the socket: the client gets an error in seconds, not a hang.
        answer = machine.rpc(MEMBER, PING, timeout=60)
        assert len(answer) == 1 and (answer[0].get("closed") or answer[0].get("connect_error")), answer
        assert machine.active("sandboxd.socket") == "failed"
    finally:
        machine.sh(f"cp /root/config.yaml.good {config} && systemctl reset-failed sandboxd.service sandboxd.socket"
                   " && systemctl start sandboxd.socket")
    assert machine.rpc(MEMBER, PING) == [PONG]  # fixed, and the socket started: served again


def test_stop_leaves_no_container_and_the_journal_holds_json_lines_without_the_secret(
        machine: Machine, docker_api: Any) -> None:
    secret = f"sbd-secret-{uuid.uuid4().hex}"
    # A user tool that echoes its env token to stdout, stderr, progress and a thrown error;
    # with log_level debug (applied by a reload) the daemon logs the tool's stderr lines.
    assert machine.rpc(MEMBER, call("hello", {"name": "first"}))[0]["result"]["status"] == "ok"  # makes the user's folder
    tools = DATA_PATH / A / "tools"
    machine.sh(f"install -d -m 0755 '{tools}' && cp -R /src/tests/e2e/hostile/secret_echo '{tools}/'"
               f" && chmod -R a+rX '{tools}'"
               " && sed -i 's/^log_level: info/log_level: debug/' /etc/sandboxd/config.yaml"
               " && systemctl reload sandboxd.service")
    machine.wait_for(lambda: machine.events("config_reloaded")
                     and "log_level" in machine.events("config_reloaded")[-1]["applied"], "the log level reload")
    answer = machine.rpc(MEMBER, call("secret_echo", {"password": "not-the-secret", "fail": True},
                                      env={"OFFICER_APIFY_TOKEN": secret}))[0]
    assert answer["result"]["status"] == "error" and secret in json.dumps(answer["result"]), answer  # it had the secret
    machine.wait_for(lambda: [e for e in machine.events("tool_stderr") if "late timer" in e.get("line", "")],
                     "the tool's late stderr line in the journal")
    assert instance_containers(docker_api)  # sandboxes are running: the stop has something to remove

    machine.sh("systemctl stop sandboxd.service sandboxd.socket", timeout=180)
    assert machine.active("sandboxd.service") == "inactive"
    assert instance_containers(docker_api) == []  # removed before the daemon exited
    assert machine.sh(f"test -e {SOCKET}", check=False).returncode != 0  # RemoveOnStop=yes

    by_pid: dict[str, list[str]] = {}
    for entry in machine.daemon_output():
        by_pid.setdefault(entry["_PID"], []).append(entry["MESSAGE"])
    for pid, lines in by_pid.items():
        if lines[0].startswith("sandboxd: invalid configuration"):
            assert len(lines) == 1, lines  # a config that does not load: one plain line before logging starts
            continue
        for line in lines:  # every line a running daemon wrote is one JSON object
            event = json.loads(line)
            assert isinstance(event, dict) and {"event", "level", "timestamp"} <= event.keys(), line
    assert any(len(lines) > 1 for lines in by_pid.values())  # at least one daemon ran and was checked
    everything = machine.sh("journalctl --no-pager -o export").stdout  # every field of every entry, every unit
    assert secret not in everything
    assert [e for e in machine.events("tool_stderr") if "token=***" in e["line"]]  # masked, not dropped
