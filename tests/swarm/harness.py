"""Three Docker engines on this machine, joined as a Swarm, for packaging/swarm/'s e2e tests.

Each engine (a "host") runs in network, mount, UTS and PID namespaces of its own: a veth to
a bridge in a fourth network namespace, an address on a /29 with no default route (nothing
leaves the machine), its own /run (its socket, exec-root, containerd), hostname and data
root. Killing a host's PID-namespace init takes its whole engine down at once: dockerd,
containerd, the shims and every container. ``down`` removes all of it, also after a failure
or for a run whose process died (its state file says what it made).

Manual use, as root: ``python -m tests.swarm.harness up`` (prints each host's DOCKER_HOST)
and ``python -m tests.swarm.harness down`` (removes every swarm this harness left).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable

from tests.e2e.hostile_harness import wait_until

SUBNET = "192.168.239"  # the hosts' /29: .1, .2, .3; no default route anywhere
ADDRESS_POOL = "10.231.0.0/16"  # the overlay networks' subnets, clear of the /29
STATE_ROOT = Path(tempfile.gettempdir())
PREFIX = "sdsw-"  # every run's folder is STATE_ROOT/sdsw-<tag>
HOSTS = 3
STRIP_KILL_S = 20.0


def unusable() -> str | None:
    """Why a swarm of local engines cannot be made here, or None."""
    if os.geteuid() != 0:
        return "needs root (network namespaces, dockerd)"
    for tool in ("dockerd", "docker", "nsenter", "unshare", "ip"):
        if shutil.which(tool) is None:
            return f"needs {tool} (scripts/ci-deps.sh and scripts/ensure-docker.sh install it)"
    if init_binary() is None:
        return "needs tini (Debian's tini, a dependency of docker.io) as each host's init"
    probe = subprocess.run(["ip", "link", "add", "sdswprobe0", "type", "vxlan", "id", "42", "dstport", "4789"],
                           capture_output=True, text=True)
    if probe.returncode != 0:
        return f"the kernel cannot make VXLAN links, which overlay networks need ({probe.stderr.strip()})"
    subprocess.run(["ip", "link", "del", "sdswprobe0"], capture_output=True)
    return None


def init_binary() -> str | None:
    return shutil.which("tini") or shutil.which("docker-init")


def run(*command: str, check: bool = True, timeout: float = 120, **kwargs: object) -> str:
    done = subprocess.run(command, capture_output=True, text=True, timeout=timeout, **kwargs)  # type: ignore[call-overload]
    if check and done.returncode != 0:
        raise RuntimeError(f"{' '.join(command)} exited {done.returncode}: {done.stderr.strip() or done.stdout.strip()}")
    return str(done.stdout).strip()


@dataclass
class Host:
    index: int
    tag: str
    root: Path
    pid: int = 0  # unshare's pid; its child is the host's PID-namespace init
    pidns: str = ""  # that namespace, as /proc/PID/ns/pid names it
    process: subprocess.Popen[bytes] | None = None

    @property
    def name(self) -> str:
        return f"host{self.index}"

    @property
    def netns(self) -> str:
        return f"{PREFIX}{self.tag}-{self.index}"

    @property
    def address(self) -> str:
        return f"{SUBNET}.{self.index}"

    @property
    def veth(self) -> str:
        """The bridge's end of this host's link, in the bridge's namespace: down cuts the host off."""
        return f"v{self.index}"

    @property
    def docker_host(self) -> str:
        return f"unix://{self.root}/run/docker.sock"

    @property
    def cgroup_parent(self) -> str:
        return f"{PREFIX}{self.tag}-{self.index}"

    def docker(self, *args: str, timeout: float = 120, check: bool = True, **kwargs: object) -> str:
        return run("docker", "-H", self.docker_host, *args, timeout=timeout, check=check, **kwargs)

    def alive(self) -> bool:
        return bool(self.pidns) and bool(_in_namespace(self.pidns))


@dataclass
class Swarm:
    tag: str = field(default_factory=lambda: os.urandom(3).hex())
    hosts: list[Host] = field(default_factory=list)

    @property
    def root(self) -> Path:
        return STATE_ROOT / f"{PREFIX}{self.tag}"

    @property
    def bridge_netns(self) -> str:
        return f"{PREFIX}{self.tag}-br"

    @property
    def data_path(self) -> Path:
        """The same path on every host, each host's own folder behind it (a bind in its mount namespace)."""
        return self.root / "data"

    @property
    def manager(self) -> Host:
        return self.hosts[0]

    # -- up ---------------------------------------------------------------------------------
    def up(self, images: Iterable[str] = ()) -> Swarm:
        """Make the network, start the engines, form the swarm, load ``images`` on every host."""
        self.root.mkdir(mode=0o700)
        self.hosts = [Host(i, self.tag, self.root / f"host{i}") for i in range(1, HOSTS + 1)]
        self._save_state()
        self._network()
        for host in self.hosts:
            self._start_engine(host)
        self._save_state()
        for host in self.hosts:
            wait_until(lambda h=host: h.docker("info", "-f", "{{.ID}}", check=False, timeout=10) != "", 60,
                     f"{host.name}'s engine to answer (log: {host.root}/dockerd.log)")
        self._form_swarm()
        self.load_images(list(images))
        return self

    def _network(self) -> None:
        run("ip", "netns", "add", self.bridge_netns)
        bridge = ("ip", "-n", self.bridge_netns)
        run(*bridge, "link", "add", "br0", "type", "bridge")
        run(*bridge, "link", "set", "br0", "up")
        for host in self.hosts:
            run("ip", "netns", "add", host.netns)
            run(*bridge, "link", "add", host.veth, "type", "veth", "peer", "name", "eth0", "netns", host.netns)
            run(*bridge, "link", "set", host.veth, "master", "br0", "up")
            inside = ("ip", "-n", host.netns)
            run(*inside, "addr", "add", f"{host.address}/29", "dev", "eth0")
            run(*inside, "link", "set", "eth0", "up")
            run(*inside, "link", "set", "lo", "up")

    def _start_engine(self, host: Host) -> None:
        for folder in ("run", "docker", "data"):
            (host.root / folder).mkdir(parents=True, exist_ok=True)
        self.data_path.mkdir(exist_ok=True)
        (host.root / "daemon.json").write_text("{}\n")
        dockerd = [
            "dockerd", "--config-file", f"{host.root}/daemon.json", "--data-root", f"{host.root}/docker",
            "--exec-root", "/run/docker", "--pidfile", "/run/docker.pid", "-H", "unix:///run/docker.sock",
            "--bridge=none", "--iptables=false", "--ip-masq=false",
            "--containerd-namespace", f"{PREFIX}{self.tag}", "--containerd-plugins-namespace", f"{PREFIX}{self.tag}-plugins",
            "--cgroup-parent", f"/{host.cgroup_parent}",
        ]
        # Its own /run (no system containerd socket there, so dockerd starts its own) and its own
        # folder at the one data path every host shares in name.
        script = (
            f"set -e; hostname {host.name}; mount --bind {host.root}/run /run; "
            f"mount --bind {host.root}/data {self.data_path}; "
            f"exec {' '.join(dockerd)} >{host.root}/dockerd.log 2>&1"
        )
        process = subprocess.Popen(
            ["nsenter", f"--net=/run/netns/{host.netns}", "unshare", "--mount", "--propagation", "slave", "--uts",
             "--pid", "--fork", "--mount-proc", "--kill-child", str(init_binary()), "-s", "--", "sh", "-c", script],
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=open(host.root / "init.log", "wb"),
            start_new_session=True,
        )
        host.pid, host.process = process.pid, process
        wait_until(lambda: _children(process.pid), 10, f"{host.name}'s init to start")
        host.pidns = os.readlink(f"/proc/{_children(process.pid)[0]}/ns/pid")

    def _form_swarm(self) -> None:
        manager = self.manager
        manager.docker("swarm", "init", "--advertise-addr", manager.address, "--listen-addr", f"{manager.address}:2377",
                       "--default-addr-pool", ADDRESS_POOL, "--dispatcher-heartbeat", "1s")
        token = manager.docker("swarm", "join-token", "-q", "manager")
        for host in self.hosts[1:]:
            host.docker("swarm", "join", "--token", token, "--advertise-addr", host.address,
                        "--listen-addr", f"{host.address}:2377", f"{manager.address}:2377")

    def load_images(self, images: list[str]) -> None:
        """``docker save`` once, ``docker load`` on every host: no registry between them."""
        if not images:
            return
        archive = self.root / "images.tar"
        run("docker", "save", "-o", str(archive), *images, timeout=300)
        loads = [subprocess.Popen(["docker", "-H", h.docker_host, "load", "-q", "-i", str(archive)],
                                  stdout=subprocess.DEVNULL, stderr=subprocess.PIPE) for h in self.hosts]
        for host, load in zip(self.hosts, loads):
            _, err = load.communicate(timeout=300)
            if load.returncode != 0:
                raise RuntimeError(f"docker load on {host.name} failed: {err.decode().strip()}")
        archive.unlink()

    # -- faults -------------------------------------------------------------------------------
    def kill_engine(self, host: Host) -> None:
        """The host dies at once: its init is killed, and with it every process of its PID namespace."""
        _kill(host)
        _wait_gone(host)

    def cut_off(self, host: Host, *, cut: bool = True) -> None:
        run("ip", "-n", self.bridge_netns, "link", "set", host.veth, "down" if cut else "up")

    # -- measures -----------------------------------------------------------------------------
    def rss_bytes(self) -> int:
        """Resident memory of every process of every host: engines, containerd, shims, containers."""
        return sum(_rss(pid) for host in self.hosts for pid in _descendants(host.pid))

    # -- down ---------------------------------------------------------------------------------
    def _save_state(self, owner: int | None = None) -> None:
        state = {"owner": os.getpid() if owner is None else owner, "tag": self.tag,
                 "hosts": [[h.pid, h.pidns] for h in self.hosts]}
        (self.root / "state.json").write_text(json.dumps(state))

    def hand_over(self) -> None:
        """No process owns this swarm any more (``up`` by hand): only ``down`` removes it."""
        self._save_state(owner=0)

    def down(self) -> None:
        """Remove everything ``up`` made, whatever state it got to."""
        alive = [host for host in self.hosts if host.alive()]
        for host in alive:  # all at once: each host's processes take a while to exit on a busy machine
            _kill(host)
        for host in alive:
            try:
                _wait_gone(host)
            except AssertionError as exc:
                print(f"swarm harness: {exc}", file=sys.stderr)
        for netns in [h.netns for h in self.hosts] + [self.bridge_netns]:
            if Path(f"/run/netns/{netns}").exists():
                run("ip", "netns", "del", netns, check=False)
        for host in self.hosts:
            _remove_cgroups(host.cgroup_parent)
        for mount in _mounts_under(self.root):
            run("umount", "--lazy", mount, check=False)
        # Three engines' image stores: removed side by side.
        removals = [subprocess.Popen(["rm", "-rf", "--one-file-system", str(host.root)]) for host in self.hosts]
        for removal in removals:
            removal.wait()
        shutil.rmtree(self.root, ignore_errors=True)


def _kill(host: Host) -> None:
    for pid in _in_namespace(host.pidns)[:1] + [host.pid]:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def _wait_gone(host: Host) -> None:
    if host.process is not None:
        host.process.wait(timeout=STRIP_KILL_S)
    wait_until(lambda: not _in_namespace(host.pidns), STRIP_KILL_S, f"{host.name}'s processes to exit")


def _parents() -> dict[int, int]:
    parents = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            parents[int(stat.parent.name)] = int(stat.read_text().rpartition(")")[2].split()[1])
        except (OSError, ValueError, IndexError):
            continue
    return parents


def _children(pid: int) -> list[int]:
    return [child for child, parent in _parents().items() if parent == pid]


def _descendants(pid: int) -> list[int]:
    """``pid`` and every process under it: a host's unshare, its init, engine, shims and containers."""
    children: dict[int, list[int]] = {}
    for child, parent in _parents().items():
        children.setdefault(parent, []).append(child)
    members, todo = [], [pid]
    while todo:
        members.append(todo.pop())
        todo.extend(children.get(members[-1], []))
    return members


def _in_namespace(pidns: str) -> list[int]:
    """The processes of PID namespace ``pidns``, its init first (containers' own namespaces are below it)."""
    members = []
    for link in Path("/proc").glob("[0-9]*/ns/pid"):
        try:
            if os.readlink(link) == pidns:
                members.append(int(link.parent.parent.name))
        except OSError:
            continue
    return sorted(members, key=_pid_inside)


def _pid_inside(pid: int) -> int:
    """``pid``'s number in its innermost PID namespace (1 for an init); 0 once it is gone."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("NSpid:"):
                return int(line.split()[-1])
    except OSError:
        pass
    return 0


def _rss(pid: int) -> int:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def _remove_cgroups(parent: str) -> None:
    """Docker leaves its containers' cgroup folders (cgroup v1: one per controller); deepest first."""
    for controller in Path("/sys/fs/cgroup").iterdir():
        top = controller / parent
        if not top.is_dir():
            continue
        for folder in sorted((p for p in top.rglob("*") if p.is_dir()), key=lambda p: len(p.parts), reverse=True):
            folder.rmdir()
        top.rmdir()


def _mounts_under(root: Path) -> list[str]:
    points = [line.split()[1] for line in Path("/proc/mounts").read_text().splitlines()]
    return sorted((p for p in points if p.startswith(f"{root}/")), key=len, reverse=True)


def leftovers(*, manual: bool) -> list[Swarm]:
    """Swarms this harness made whose test run is gone (it was killed); ``manual``: those ``up`` made too."""
    found = []
    for state_file in STATE_ROOT.glob(f"{PREFIX}*/state.json"):
        state = json.loads(state_file.read_text())
        owner = state["owner"]
        if (owner == 0 and manual) or (owner and not Path(f"/proc/{owner}").exists()):
            swarm = Swarm(tag=state["tag"])
            swarm.hosts = [Host(i, swarm.tag, swarm.root / f"host{i}", pid, pidns)
                           for i, (pid, pidns) in enumerate(state["hosts"], start=1)]
            found.append(swarm)
    return found


def main(argv: list[str]) -> int:
    if argv[1:] == ["down"]:
        for swarm in leftovers(manual=True):
            print(f"removing swarm {swarm.tag} ({swarm.root})")
            swarm.down()
        return 0
    if argv[1:] == ["up"]:
        reason = unusable()
        if reason:
            print(f"tests.swarm.harness: cannot make a swarm here: {reason}", file=sys.stderr)
            return 1
        swarm = Swarm().up()
        # The state file names this process as the owner: hand it to a process that lives on.
        swarm.hand_over()
        for host in swarm.hosts:
            print(f"{host.name} {host.address} DOCKER_HOST={host.docker_host}")
        return 0
    print("usage: python -m tests.swarm.harness up|down", file=sys.stderr)
    return 2


if __name__ == "__main__":
    raise SystemExit(main(sys.argv))
