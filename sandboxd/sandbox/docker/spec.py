"""What a sandbox's container is made of: a pure function of the settings and the ``SandboxSpec``.

Nothing here talks to the engine or touches the disk, so a unit test reads every hardening
flag of a sandbox one by one (tests/unit/test_docker_spec.py). The backend passes the
result to the SDK as it is: ``create_host_config(**spec.host_config)``, then
``create_container(**spec.container)``.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from docker.types import LogConfig, Mount, Ulimit

from sandboxd.config import AUTO_SANDBOX_ID, SandboxConfig
from sandboxd.container import (CONTAINER_CACHE, CONTAINER_EMAIL_DB, CONTAINER_TOOLS, CONTAINER_USER, CONTAINER_USER_TOOLS,
                                sandbox_env)
from sandboxd.sandbox.backend import SandboxSpec
from sandboxd.sandbox.mounts import Bind
from sandboxd.sandbox.docker.seccomp import sandbox_profile
from sandboxd.tools.transpile_cache import CACHE_ENV

LABEL_MANAGED = "org.sandboxd.managed"
LABEL_INSTANCE = "org.sandboxd.instance"
LABEL_USER = "org.sandboxd.user"
LABEL_DATA_PATH = "org.sandboxd.data-path"  # for people: what the instance label is a hash of
CONTAINER_SHIM_DIR = "/officer/run"
SHIM_SOCKET_NAME = "shim.sock"
EGRESS_SOCKET_NAME = "egress.sock"
# With no network (network_disabled) Docker leaves /etc/hosts empty, and `localhost` would not
# resolve in a sandbox: tools reach the browser relay at localhost:PORT as at 127.0.0.1:PORT.
HOSTS_NAME = "hosts"
LOOPBACK_HOSTS = "127.0.0.1\tlocalhost\n::1\tlocalhost ip6-localhost ip6-loopback\n"
CPU_PERIOD_US = 100_000  # the kernel's default CFS period


def gvisor_pids_limit(pids_limit: int) -> int:
    """The host's pids limit for a gVisor sandbox whose tools may have ``pids_limit`` threads.

    Under gVisor the limit counts host threads: the Sentry's and the gofer's own (~40 idle,
    ~90 with the shim's node), and on the ptrace platform a stub thread per sandbox thread and
    the Sentry threads that trace them. Measured, an OCR of a PDF: 23 threads under runc, 174
    host threads under runsc. At the limit the Sentry dies on its next clone (exit code 2, the
    call ``crashed``): 128 + 64 was hit in CI by that OCR on a busy machine. The headroom is a
    constant, not a multiple: a fork bomb under a large limit (4096) would otherwise leave
    twice as many host threads for the kill to end (test_kill went from 1.9 s to over 15 s).
    """
    return pids_limit + 256


def sandbox_user(setting: str) -> str:
    """uid:gid the tool runs as. auto: AUTO_SANDBOX_ID, an id with no account on the host (docs/install.md)."""
    if setting != "auto":
        return setting
    return f"{AUTO_SANDBOX_ID}:{AUTO_SANDBOX_ID}"


def sandbox_uid(setting: str) -> int:
    return int(sandbox_user(setting).split(":")[0])


def owned_labels(instance: str) -> dict[str, str]:
    """What marks a container (or a network) as this daemon's: ``remove_orphans`` finds it by them."""
    return {LABEL_MANAGED: "1", LABEL_INSTANCE: instance}


@dataclass(frozen=True)
class ContainerSpec:
    """The keyword arguments of the SDK's ``create_host_config`` and ``create_container``
    (the latter without ``host_config``, made from the former)."""

    host_config: dict[str, Any]
    container: dict[str, Any]


def container_spec(config: SandboxConfig, spec: SandboxSpec, *, instance: str, name: str, binds: list[Bind],
                   shim_dir: Path | None, network: str, gvisor: bool = False,
                   groups: tuple[int, ...] = ()) -> ContainerSpec:
    """The hardened container of one sandbox.

    ``binds``: the user's folders as sandbox/mounts.py checked them; ``shim_dir``: the
    sandbox's socket directory (socket transport), None in attach mode, where the protocol
    runs over stdin/stdout; ``network``: the network it joins (none unless egress is
    configured to go through the daemon's bridge); ``gvisor``: the runtime is gVisor's;
    ``groups``: supplementary groups of the sandbox's processes (gVisor only: the owning
    groups of its folders, see ``folder_groups``).
    """
    mounts = [Mount(bind.target, bind.source, type="bind", read_only=bind.read_only) for bind in binds]
    mounts += [Mount(target, str(source), type="bind", read_only=True) for source, target in spec.read_only_mounts]
    environment = sandbox_env(home=CONTAINER_USER, tools_dir=CONTAINER_TOOLS, user_tools_dir=CONTAINER_USER_TOOLS,
                              email_db=CONTAINER_EMAIL_DB)
    if spec.transpile_cache is not None:
        environment[CACHE_ENV] = CONTAINER_CACHE
    if shim_dir is not None:
        mounts.append(Mount(CONTAINER_SHIM_DIR, str(shim_dir), type="bind", read_only=True))
        if config.network == "none":  # the socket directory holds it (sockets.py)
            mounts.append(Mount("/etc/hosts", str(shim_dir / HOSTS_NAME), type="bind", read_only=True))
        environment["SANDBOXD_SHIM_SOCKET"] = f"{CONTAINER_SHIM_DIR}/{SHIM_SOCKET_NAME}"
        if spec.egress is not None:  # the shim routes fetch, http(s) and child processes through it
            environment["SANDBOXD_EGRESS_SOCKET"] = f"{CONTAINER_SHIM_DIR}/{EGRESS_SOCKET_NAME}"
    security_opt = ["no-new-privileges"] if config.no_new_privileges else []
    if not gvisor:  # runsc filters its Sentry's host syscalls itself; it reads an OCI profile only with --oci-seccomp
        security_opt.append(f"seccomp={sandbox_profile()}")
    host_config: dict[str, Any] = dict(
        mounts=mounts,
        # /officer/data is the email database's host folder (in binds): SQLite's journal and WAL go there.
        tmpfs={"/tmp": f"rw,nosuid,nodev,size={config.tmp_size}"},
        read_only=config.read_only_root,
        cap_drop=["ALL"],
        cap_add=config.cap_add or None,
        security_opt=security_opt or None,
        mem_limit=config.memory,
        memswap_limit=config.memory,  # no swap: the limit is the limit
        # The CFS quota itself rather than nano_cpus (the same limit), because only a quota can be
        # lifted on a running container: a condemned sandbox's is, before the kill (backend.py).
        cpu_period=CPU_PERIOD_US,
        cpu_quota=int(config.cpus * CPU_PERIOD_US),
        pids_limit=gvisor_pids_limit(config.pids_limit) if gvisor else config.pids_limit,
        ulimits=[Ulimit(name="core", soft=0, hard=0), Ulimit(name="nofile", soft=4096, hard=4096)],
        init=config.init,
        network_mode=network,
        runtime=config.runtime,
        ipc_mode="private",
        group_add=[str(gid) for gid in groups] or None,
        # Tool output is read over attach; a json-file log would let a flood fill the disk.
        log_config=LogConfig(type=LogConfig.types.NONE),
    )
    container: dict[str, Any] = dict(
        image=config.image,
        name=name,
        stdin_open=shim_dir is None,  # the protocol's way in, in attach mode only
        tty=False,
        user=sandbox_user(config.user),
        environment=environment,
        working_dir=CONTAINER_USER,
        labels={**owned_labels(instance), LABEL_USER: spec.user, LABEL_DATA_PATH: str(spec.root)},
        network_disabled=config.network == "none",
    )
    return ContainerSpec(host_config, container)


def esbuild_source_spec(image: str, instance: str) -> dict[str, Any]:
    """``create_container``'s arguments for the container the image's esbuild is copied out of:
    created, never started (nothing of the image runs), labelled so a crash leaves no orphan."""
    return dict(image=image, command=["true"], entrypoint=[], labels=owned_labels(instance), network_disabled=True)


def folder_groups(binds: list[Bind], gid_of: Callable[[str], int]) -> tuple[int, ...]:
    """The groups a gVisor sandbox joins so that it can use its folders.

    sandbox/mounts.py gives the sandbox uid access to its folders with POSIX ACLs, which
    gVisor's kernel does not read: it checks the mode bits alone, where an ACL's mask
    shows as the group's bits. Joining each folder's owning group gives the sandbox, under
    gVisor, the access its ACL entry gives it under runc, on its own mounts only (nothing
    else of the host is in its mount namespace). ``gid_of``: a folder's owning group.
    """
    return tuple(sorted({gid_of(bind.source) for bind in binds}))
