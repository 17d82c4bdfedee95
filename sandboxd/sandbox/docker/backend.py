"""Docker backend: one hardened container per sandbox, its shim on a unix socket.

The docker SDK is synchronous; its calls run in a small thread pool, and asyncio handles
each sandbox's connections (sandbox.py). One concern a file: the container a
sandbox is made of (spec.py, a pure function), its socket directory
(sockets.py), the attach stream's frames (attach.py), the words that say why
it ended (exits.py); this module is what talks to the engine.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import os
import secrets
import shutil
import tempfile
from pathlib import Path
from typing import Any, Callable

import docker
import docker.errors
import requests.exceptions

from sandboxd.config import BRIDGE_NETWORK, SandboxConfig
from sandboxd.errors import BackendUnavailable, ConfigError, SandboxFailed
from sandboxd.logging import get_logger
from sandboxd.sandbox.backend import SandboxSpec, container_entry_path
from sandboxd.sandbox.docker.attach import attach_socket, raw_socket
from sandboxd.sandbox.docker.esbuild import extract_esbuild
from sandboxd.sandbox.docker.exits import exit_state
from sandboxd.sandbox.docker.runtime import is_gvisor, runtime_problem
from sandboxd.sandbox.docker.sandbox import DockerSandbox
from sandboxd.sandbox.docker.sentry import Outcome, kill_sentry, kill_through_helper, lift_cpu_quota
from sandboxd.sandbox.docker.sockets import SandboxPeer, SandboxSockets
from sandboxd.sandbox.docker.spec import (
    LABEL_INSTANCE,
    LABEL_MANAGED,
    LABEL_USER,
    container_spec,
    folder_groups,
    sandbox_uid,
)
from sandboxd.sandbox.mounts import sandbox_binds
from sandboxd.sandbox.shim import SHIM_PROTOCOL
from sandboxd.tools.discovery import Tool
from sandboxd.tools.esbuild import Esbuild
from sandboxd.unixsocket import secure_directory

log = get_logger("sandboxd.docker")

# Docker drops traffic between two containers on a bridge with this option "false".
ICC_OPTION = "com.docker.network.bridge.enable_icc"
ATTACH_HINT = "set sandbox.transport: attach"
# Docker's answer when it SIGKILLed a container's process itself and stopped waiting for the exit 2 s later.
KILL_GAVE_UP = "did not receive an exit event"
EXIT_WAIT_S = 20  # how long a removal waits for the exit of a container it (or the engine) SIGKILLed

# Errors that mean "the engine is not there", as opposed to "it said no".
_UNREACHABLE = (requests.exceptions.ConnectionError, docker.errors.DockerException, OSError)


def engine_url(config: SandboxConfig) -> str:
    return config.docker_host or os.environ.get("DOCKER_HOST") or "unix://"


def shim_dir_problem(info: dict[str, Any], shim_dir: Path) -> str | None:
    """Why an engine on this host (its ``docker info``) cannot bind-mount ``shim_dir``, or None.

    A rootless engine runs in a user and mount namespace of its own: paths made after it
    started (the daemon's runtime directory under /run, say) are not there, and the
    sandbox uid is not mapped in it. Its "rootless" security option says so reliably.
    """
    options = info.get("SecurityOptions") or []
    if any("name=rootless" in option.split(",") for option in options):
        return f"the Docker engine is rootless and cannot see {shim_dir}; {ATTACH_HINT}"
    return None


class DockerBackend:
    name = "docker"

    def __init__(self, config: SandboxConfig, *, instance: str, max_line_bytes: int,
                 shim_dir: Path | None = None, helper: Path | None = None) -> None:
        """``shim_dir`` holds the sandboxes' socket directories (socket transport): a
        directory of this daemon's own that the Docker engine can see at the same path.
        None = a private temporary directory, removed by ``close``. ``helper``: the privileged
        helper's socket, asked to kill a gVisor sandbox's Sentry that this daemon may not signal."""
        self.config = config
        self.instance = instance
        self.max_line_bytes = max_line_bytes
        self._shim_dir = shim_dir
        self._helper = helper
        self._shim_dir_is_temporary = shim_dir is None
        self._shim_dir_ready = False
        self._engine_checked = False  # _engine_problem found none on the engine that answered
        self._gvisor = False  # sandbox.runtime is gVisor's (as that engine has it registered)
        self._sentry_warned = False  # said once that a gVisor sandbox's kill goes through its Sentry
        if shim_dir is not None and config.transport == "socket":
            self._prepare_shim_dir()  # an unsafe directory stops start-up (OSError), not every later call
        self._api: docker.APIClient | None = None
        # Enough threads that a burst of starts does not queue behind slow removes.
        self._executor = concurrent.futures.ThreadPoolExecutor(max_workers=16, thread_name_prefix="docker")
        # Containers whose removal failed (engine down or restarting): removed once it answers again.
        self._unremoved: set[str] = set()
        self._cleanups: set[asyncio.Task[None]] = set()

    def reconfigure(self, config: SandboxConfig) -> None:
        """Settings for sandboxes started from now on (on reload; the engine connection stays)."""
        self.config = config
        self._engine_checked = False  # the transport may have changed

    # -- plumbing -------------------------------------------------------------

    def api(self) -> docker.APIClient:
        if self._api is None:
            kwargs: dict[str, Any] = {"base_url": self.config.docker_host} if self.config.docker_host else docker.utils.kwargs_from_env()
            self._api = docker.APIClient(version="auto", timeout=60, **kwargs)
        return self._api

    async def _run(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        loop = asyncio.get_running_loop()
        try:
            return await loop.run_in_executor(self._executor, lambda: fn(*args, **kwargs))
        except docker.errors.ImageNotFound:
            raise BackendUnavailable(
                f"the runner image {self.config.image} is not built; run `make image` (or set sandbox.image)."
            ) from None
        except docker.errors.APIError as exc:
            raise BackendUnavailable(f"the Docker engine refused: {exc.explanation or exc}") from None
        except _UNREACHABLE as exc:
            self._api = None  # reconnect (and renegotiate the API version) next time
            raise BackendUnavailable(
                f"the Docker engine is not reachable ({type(exc).__name__}); start it (e.g. systemctl start docker) "
                "and sandboxd recovers by itself.",
            ) from None

    def shim_dir(self) -> Path:
        """The directory of the sandboxes' socket directories: ours alone (0700), emptied of
        what an earlier run left."""
        if self._shim_dir is None:
            self._shim_dir = Path(tempfile.mkdtemp(prefix="sandboxd-shims-"))
        if not self._shim_dir_ready:
            try:
                self._prepare_shim_dir()
            except OSError as exc:
                raise BackendUnavailable(str(exc)) from None
        return self._shim_dir

    def _prepare_shim_dir(self) -> None:
        """Check the shim sockets' directory (and, beside the API socket, that socket's
        directory too): whoever could write either could plant a socket a shim connects to,
        or swap the directory itself. OSError says what to fix."""
        path = self._shim_dir
        assert path is not None
        if not self._shim_dir_is_temporary:
            secure_directory(path.parent, mode=0o755, what="the socket's directory")
        secure_directory(path, mode=0o700, what="the shim sockets' directory")
        os.chmod(path, 0o700)  # nobody else may even look up a sandbox's socket
        for stale in path.iterdir():  # sockets of sandboxes an earlier run started
            if stale.is_dir() and not stale.is_symlink():
                shutil.rmtree(stale, ignore_errors=True)
            else:
                stale.unlink(missing_ok=True)
        self._shim_dir_ready = True

    def ping(self) -> bool:
        try:
            return bool(self.api().ping())
        except Exception:
            self._api = None
            return False

    def unusable(self) -> str | None:
        """Why no sandbox could start now (the engine away, the image not built), or None (blocking)."""
        if not self.ping():
            return "the Docker engine is not reachable"
        try:
            self.api().inspect_image(self.config.image)
        except docker.errors.ImageNotFound:
            return f"the runner image {self.config.image} is not built (make image)"
        except docker.errors.DockerException as exc:
            return f"the Docker engine did not answer ({exc})"
        return None

    def remove_stopped(self) -> None:
        """Remove this instance's stopped containers, leaving running ones (blocking; best effort).

        For `sandboxd run`, whose instance several runs share: a killed run leaves at most a
        stopped container, and a running one belongs to another run."""
        api = self.api()
        try:
            for container in api.containers(all=True, filters={"label": [f"{LABEL_INSTANCE}={self.instance}"],
                                                               "status": ["exited", "dead"]}):
                api.remove_container(container["Id"], force=True)
        except docker.errors.DockerException:
            pass

    # -- the Backend interface ------------------------------------------------

    @property
    def transport(self) -> str:
        return self.config.transport  # for sandboxes started from now on (it may change on reload)

    async def start(self, spec: SandboxSpec) -> DockerSandbox:
        if not self._engine_checked:
            problem = await self._engine_problem()
            if problem is not None:
                raise BackendUnavailable(problem)
        sockets = None
        if self.config.transport == "socket":
            peer = SandboxPeer(sandbox_uid(self.config.user), gvisor=self._gvisor)
            sockets = SandboxSockets(self.shim_dir(), self.instance, peer, egress=spec.egress is not None)
        try:
            sandbox = await self._start(spec, sockets)
        except BaseException:
            if sockets is not None:
                sockets.remove()
            raise
        finally:
            if sockets is not None:
                sockets.close()
        if sockets is not None and sockets.egress is not None and spec.egress is not None:
            sandbox.sockets = sockets
            sockets.serve_egress(spec.egress.session(spec.user, sandbox.id, sandbox.egress_context), sandbox.container_id)
        return sandbox

    async def _start(self, spec: SandboxSpec, sockets: SandboxSockets | None) -> DockerSandbox:
        # The create runs on in its thread even if we are cancelled: wait for it and
        # remove what it made, or shutdown would leave that container behind.
        create = asyncio.ensure_future(self._run(self._create, spec, sockets.dir if sockets else None))
        try:
            container_id = await asyncio.shield(create)
        except asyncio.CancelledError:
            try:
                await self._remove_quiet(await create)
            except Exception:
                pass
            raise
        self._retry_unremoved()
        sandbox: DockerSandbox | None = None
        try:
            attach = await self._run(lambda: attach_socket(self.api(), container_id, with_stdin=sockets is None))
            sandbox = DockerSandbox(container_id, spec.user, self.max_line_bytes, memory=self.config.memory,
                                    exit_state=lambda: self._run(lambda: exit_state(self.api(), container_id)))
            await sandbox.connect_attach(attach, raw_socket(attach))
            await self._run(lambda: self.api().start(container_id))
            if sockets is not None:
                await sandbox.connect_shim(sockets)
            ready = await sandbox.channel.ready
            if ready.get("protocol") != SHIM_PROTOCOL:
                raise BackendUnavailable(
                    f"the image {self.config.image} speaks shim protocol {ready.get('protocol')!r}, "
                    f"not {SHIM_PROTOCOL}; rebuild it with `make image`."
                )
            return sandbox
        except BaseException as exc:
            # Cancelled or failed half-way: never leave the container behind.
            if sandbox is not None:
                sandbox.destroying = True
                sandbox.close_transports()
            await asyncio.shield(self._remove_quiet(container_id))
            if isinstance(exc, SandboxFailed):
                tail = " | ".join(sandbox.stderr_tail) if sandbox is not None else ""
                raise BackendUnavailable(f"a sandbox exited before its shim was ready: {tail or exc.message}") from None
            raise

    async def destroy(self, sandbox: DockerSandbox) -> None:
        sandbox.close_egress()
        sandbox.drain()
        sandbox.channel.shutdown()
        sandbox.close_transports()
        await self._remove_quiet(sandbox.container_id)

    async def esbuild(self, directory: Path) -> Esbuild | None:
        if self.config.transport != "socket":
            return None  # attach: the engine may be remote, and cannot be assumed to see the data path
        return await self._run(lambda: extract_esbuild(self.api(), self.config.image, self.instance, directory))

    async def preflight(self, config: SandboxConfig | None = None) -> None:
        config = config or self.config
        if config.transport != "socket" and config.runtime is None:
            return
        try:
            problem = await self._engine_problem(config)
        except BackendUnavailable:
            return  # the engine is away: checked before the first sandbox starts instead
        if problem is not None:
            raise ConfigError(problem)

    async def _engine_problem(self, config: SandboxConfig | None = None) -> str | None:
        """Why the engine cannot see the shim sockets' directory or run sandbox.runtime, or None
        (then not asked again). Raises BackendUnavailable when the engine does not answer.

        ``config``: settings a reload would apply, checked without becoming this backend's.
        """
        running = config is None or config == self.config
        config = config or self.config
        engine = engine_url(config)
        socket_transport = config.transport == "socket"
        if socket_transport and not engine.startswith("unix://"):
            return f"the Docker engine at {engine} is remote and cannot see {self.shim_dir()}; {ATTACH_HINT}"
        info = await self._run(lambda: self.api().info())
        problem = shim_dir_problem(info, self.shim_dir()) if socket_transport else None
        problem = problem or runtime_problem(info, config.runtime, local=engine.startswith("unix://"))
        if running:
            self._gvisor = is_gvisor(info, config.runtime)
            self._engine_checked = problem is None
        return problem

    async def _owned(self) -> list[dict[str, Any]]:
        return await self._run(
            lambda: self.api().containers(all=True, filters={"label": [f"{LABEL_INSTANCE}={self.instance}"]})
        )

    async def remove_orphans(self) -> int:
        if self.config.transport == "socket":
            self.shim_dir()  # also removes the socket directories an earlier run left
        owned = await self._owned()
        if owned:
            log.info("orphan_containers", instance=self.instance,
                     containers=[(c.get("Names") or [c["Id"][:12]])[0].lstrip("/") for c in owned],
                     users=sorted({(c.get("Labels") or {}).get(LABEL_USER, "?") for c in owned}))
        await asyncio.gather(*(self._remove_quiet(c["Id"]) for c in owned))
        return len(owned)

    def entry_path(self, tool: Tool) -> str:
        return container_entry_path(tool)

    async def close(self) -> None:
        if self._unremoved:  # a last try, bounded: the engine may still be away
            try:
                await asyncio.wait_for(asyncio.gather(*(self._remove_quiet(c) for c in list(self._unremoved))), 10)
            except TimeoutError:
                pass
        self._executor.shutdown(wait=False, cancel_futures=True)
        if self._shim_dir is not None and self._shim_dir_is_temporary:
            shutil.rmtree(self._shim_dir, ignore_errors=True)

    # -- blocking Docker calls (run in the executor) ---------------------------

    def _create(self, spec: SandboxSpec, shim_dir: Path | None) -> str:
        # Checked below the data path without following links; the sandbox uid gets access by ACL.
        try:
            binds, warnings = sandbox_binds(spec, sandbox_uid(self.config.user))
        except OSError as exc:  # not the engine's fault: say what, not "unreachable"
            raise BackendUnavailable(f"cannot prepare the sandbox's folders for {spec.user}: {exc}") from None
        for warning in warnings:
            log.warning("sandbox_mount_access", user=spec.user, problem=warning)
        groups = folder_groups(binds, lambda path: os.stat(path, follow_symlinks=False).st_gid) if self._gvisor else ()
        made = container_spec(self.config, spec, instance=self.instance, binds=binds, shim_dir=shim_dir, gvisor=self._gvisor,
                              groups=groups,
                              name=f"sandboxd-{self.instance[:8]}-{secrets.token_hex(4)}", network=self._network())
        api = self.api()
        try:
            container = api.create_container(host_config=api.create_host_config(**made.host_config), **made.container)
        except docker.errors.APIError as exc:
            # An engine that does not share this host's filesystem (remote behind a unix
            # socket, in a VM) and that `docker info` did not give away.
            if shim_dir is not None and "bind source path does not exist" in str(exc) and str(shim_dir) in str(exc):
                raise BackendUnavailable(
                    f"the Docker engine cannot see {shim_dir.parent} (bind source path does not exist): it does not "
                    f"share this host's filesystem; {ATTACH_HINT}"
                ) from None
            raise
        return str(container["Id"])

    def _network(self) -> str:
        """The network a new sandbox joins: none by default; the daemon's bridge is made on first use.

        One network for every daemon on this engine (labelled, never removed): with
        inter-container traffic off, sandboxes on it reach neither each other nor other
        containers on it, only what lies beyond the bridge. Looked up at every start (a
        few ms), so a network removed while the daemon runs is made again.
        """
        name = self.config.network
        if name != BRIDGE_NETWORK:
            return name
        api = self.api()
        try:
            network = api.inspect_network(name)
        except docker.errors.NotFound:
            try:
                api.create_network(name, driver="bridge", options={ICC_OPTION: "false"},
                                   labels={LABEL_MANAGED: "1"}, check_duplicate=True)
                log.info("network_created", network=name, inter_container_traffic=False)
            except docker.errors.APIError as exc:
                if exc.status_code != 409:  # 409: another daemon made it at the same moment
                    raise
            network = api.inspect_network(name)
        labels, options = network.get("Labels") or {}, network.get("Options") or {}
        if labels.get(LABEL_MANAGED) != "1" or options.get(ICC_OPTION) != "false":
            raise BackendUnavailable(
                f"the Docker network {name!r} was not made by sandboxd, or lets containers on it reach each other "
                f"({ICC_OPTION}={options.get(ICC_OPTION, 'true')}); remove it (docker network rm {name}) and "
                "sandboxd makes its own"
            )
        return name

    def _remove(self, container_id: str) -> None:
        try:
            if self._gvisor:  # runsc cannot update a container: its Sentry is killed by the host instead
                self._kill_sentry(container_id)
            else:
                self._lift_cpu_quota(container_id)
        except docker.errors.NotFound:
            return
        self._remove_container(container_id)

    def _remove_container(self, container_id: str) -> None:
        api = self.api()
        try:
            api.remove_container(container_id, force=True, v=True)
        except docker.errors.NotFound:
            pass
        except docker.errors.APIError as exc:
            if KILL_GAVE_UP not in str(exc.explanation or exc):
                raise
            # The engine's own SIGKILL came after 10 s; the exit follows (seconds, for thousands of tasks).
            self._wait_exit(container_id)
            try:
                api.remove_container(container_id, force=True, v=True)
            except docker.errors.NotFound:
                pass

    def _wait_exit(self, container_id: str) -> None:
        """Wait (up to EXIT_WAIT_S) until the engine has seen a killed container exit; then its removal need not kill."""
        try:
            self.api().wait(container_id, timeout=EXIT_WAIT_S)
        except (requests.exceptions.RequestException, docker.errors.APIError):
            pass  # the removal that follows waits, or fails and is retried later, as before

    def _kill_sentry(self, container_id: str) -> None:
        """End a condemned gVisor sandbox by a SIGKILL to its Sentry on the host, its CPU quota lifted
        first (sentry.py says why); then wait for the engine to see it exit before the removal.

        Also for a Sentry that died by itself (at its pids limit, say): else the removal's kill reaches
        the shim while it reaps the ptrace stubs, and holds the init's lock until its `runsc kill` exit
        is reported, behind each stub's exit (1 s apiece once the exit queue, which waits on that lock,
        is full). The engine kept such a sandbox 66-300 s (docs/performance.md).

        Needs root (or CAP_KILL, for the kill alone), else the privileged helper does both. Without
        either the engine's kill goes through the Sentry, which takes 10 s or more for thousands of tasks.
        """
        lift_cpu_quota(container_id)  # its stubs die within the quota, even once the Sentry is dead
        state = self.api().inspect_container(container_id).get("State") or {}
        pid = int(state.get("Pid") or 0)
        if not state.get("Running") or pid <= 0:
            return
        outcome, problem = kill_sentry(pid, container_id), None
        if outcome is Outcome.NOT_PERMITTED and self._helper is not None:
            outcome, problem = kill_through_helper(self._helper, container_id)
        if outcome is not Outcome.NOT_PERMITTED:  # killed, or dead already: its exit first, then the removal
            self._wait_exit(container_id)
        if outcome is Outcome.NOT_ITS:  # exited as it was condemned (its pid reused)
            log.info("sandbox_sentry_not_seen", container=container_id[:12], pid=pid)
        elif outcome is Outcome.NOT_PERMITTED and not self._sentry_warned:
            self._sentry_warned = True
            log.warning("sandbox_killed_through_gvisor", container=container_id[:12], helper=problem,
                        consequence="a sandbox of thousands of tasks takes 10 s or more to go",
                        fix="run the daemon as root, or enable the privileged helper (systemctl enable --now "
                            "sandboxd-quota.socket; docs/security.md, gVisor)")

    def _lift_cpu_quota(self, container_id: str) -> None:
        """Let a condemned sandbox's processes run unthrottled, so that they die at once.

        Thousands of processes (a fork bomb under a large pids_limit) held to a fraction of a
        CPU each get too little time to act on SIGKILL: `docker kill` waited minutes for the
        exit (cgroup v1). With the quota lifted they die within a second or two. Freezing the
        cgroup first does not help: a throttled task reaches the freezer no sooner (measured,
        docs/performance.md). Without the lift the kill still comes, just late: logged.
        """
        try:
            self.api().update_container(container_id, cpu_quota=-1)
        except docker.errors.NotFound:
            raise
        except docker.errors.APIError as exc:
            # Not running (409, or Docker 20.10's 500 "container not running"): nothing left to throttle.
            if exc.status_code != 409 and "not running" not in str(exc.explanation or ""):
                log.warning("sandbox_cpu_quota_not_lifted", container=container_id[:12], error=str(exc),
                            consequence="its kill may wait for throttled processes")

    async def _remove_quiet(self, container_id: str) -> None:
        """Remove a container; if the engine cannot do it now, remember it for later."""
        try:
            await self._run(self._remove, container_id)
        except Exception as exc:
            self._unremoved.add(container_id)
            log.warning("docker_cleanup_deferred", container=container_id[:12], error=str(exc))
        else:
            self._unremoved.discard(container_id)

    def _retry_unremoved(self) -> None:
        """The engine answers again: remove what could not be removed while it was away."""
        for container_id in list(self._unremoved):
            self._unremoved.discard(container_id)
            task = asyncio.get_running_loop().create_task(self._remove_quiet(container_id))
            self._cleanups.add(task)
            task.add_done_callback(self._cleanups.discard)
