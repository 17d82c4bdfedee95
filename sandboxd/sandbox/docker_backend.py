"""Docker backend: one hardened container per sandbox, its shim on a unix socket.

The docker SDK is synchronous; its calls run in a small thread pool. Each sandbox
has two connections, both handled by asyncio:

- the shim protocol (``sandbox.transport: socket``, the default): the daemon listens
  on a unix socket in a directory of its own, bind-mounted read-only into the
  sandbox, and accepts exactly one connection, the shim's, made before any tool
  code runs. A call then goes daemon ↔ node directly, not through dockerd and
  containerd-shim (docs/performance.md). With ``transport: attach`` (a remote
  engine) the protocol runs over the container's stdin/stdout instead.
- docker attach: Docker's 8-byte frame headers demultiplexed (stream 2 stderr =
  tool output; stream 1 stdout = the protocol in attach mode); its end is how the
  daemon learns that a container exited.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import os
import secrets
import shutil
import socket
import struct
import tempfile
from pathlib import Path
from typing import Any, Awaitable, Callable

import docker
import docker.errors
import requests.exceptions
from docker.types import LogConfig, Mount, Ulimit

from sandboxd.config import AUTO_SANDBOX_ID, BRIDGE_NETWORK, SandboxConfig
from sandboxd.errors import BackendUnavailable, ConfigError, SandboxFailed
from sandboxd.logging import get_logger
from sandboxd.sandbox.backend import (
    CONTAINER_CACHE,
    CONTAINER_EMAIL_DB,
    CONTAINER_TOOLS,
    CONTAINER_USER,
    CONTAINER_USER_TOOLS,
    EgressSession,
    SandboxSpec,
    container_entry_path,
    sandbox_env,
)
from sandboxd.sandbox.mounts import sandbox_binds
from sandboxd.sandbox.shim import SHIM_PROTOCOL, ShimSandbox
from sandboxd.service.peercred import peer_credentials
from sandboxd.tools.discovery import Tool
from sandboxd.tools.transpile_cache import CACHE_ENV, Esbuild, extract_esbuild
from sandboxd.unixsocket import secure_directory

log = get_logger("sandboxd.docker")

LABEL_MANAGED = "org.sandboxd.managed"
LABEL_INSTANCE = "org.sandboxd.instance"
LABEL_USER = "org.sandboxd.user"
LABEL_DATA_PATH = "org.sandboxd.data-path"  # for people: what the instance label is a hash of
_FRAME = struct.Struct(">BxxxL")
CONTAINER_SHIM_DIR = "/officer/run"
EXIT_WAIT_S = 5.0  # how long a sandbox whose shim hung up may take to exit
SHIM_SOCKET_NAME = "shim.sock"
EGRESS_SOCKET_NAME = "egress.sock"
# Docker drops traffic between two containers on a bridge with this option "false".
ICC_OPTION = "com.docker.network.bridge.enable_icc"

# Errors that mean "the engine is not there", as opposed to "it said no".
_UNREACHABLE = (requests.exceptions.ConnectionError, docker.errors.DockerException, OSError)


def sandbox_user(setting: str) -> str:
    """uid:gid the tool runs as. auto: AUTO_SANDBOX_ID, an id with no account on the host (docs/install.md)."""
    if setting != "auto":
        return setting
    return f"{AUTO_SANDBOX_ID}:{AUTO_SANDBOX_ID}"


ATTACH_HINT = "set sandbox.transport: attach"


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


class _ShimListener:
    """The sockets of one sandbox, in a directory only that sandbox mounts.

    The parent directory is the daemon's own (0700), so on the host only root and the
    daemon's user can reach them. ``shim.sock``: the shim connects once, before any tool
    code runs, and the listener is gone after that one connection, which must come from
    the sandbox's uid (SO_PEERCRED), or the start fails. ``egress.sock`` (when the sandbox
    has a way out) stays for the sandbox's life: its proxy (egress/proxy.py).
    """

    def __init__(self, parent: Path, instance: str, uid: int, *, egress: bool = False) -> None:
        self.uid = uid
        self.dir = parent / f"{instance[:12]}-{secrets.token_hex(6)}"
        self.dir.mkdir(mode=0o755)
        os.chmod(self.dir, 0o755)  # the sandbox's user must traverse it (umask aside)
        self.sock: socket.socket | None = None
        self.egress: socket.socket | None = None
        try:
            self.sock = self._bind(SHIM_SOCKET_NAME, backlog=1)
            if egress:
                self.egress = self._bind(EGRESS_SOCKET_NAME, backlog=64)
        except BaseException:
            self.close()
            self.remove()
            raise

    def _bind(self, name: str, backlog: int) -> socket.socket:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            # Through the directory's fd: a socket path longer than 108 bytes still binds.
            dir_fd = os.open(self.dir, os.O_PATH | os.O_DIRECTORY)
            try:
                sock.bind(f"/proc/self/fd/{dir_fd}/{name}")
            finally:
                os.close(dir_fd)
            os.chmod(self.dir / name, 0o666)  # the sandbox's uid may differ from ours
            sock.listen(backlog)
            sock.setblocking(False)
        except BaseException:
            sock.close()
            raise
        return sock

    async def accept(self) -> socket.socket:
        assert self.sock is not None
        conn, _ = await asyncio.get_running_loop().sock_accept(self.sock)
        peer = peer_credentials(conn)
        if peer.uid != self.uid:
            conn.close()
            raise BackendUnavailable(
                f"a process that is not the sandbox's shim (pid {peer.pid}, uid {peer.uid}; the sandbox runs as "
                f"{self.uid}) connected to its socket {self.dir / SHIM_SOCKET_NAME}; the sandbox was not used"
            )
        return conn

    def close(self) -> None:
        """Stop listening for the shim and remove its socket (the sandbox keeps its open connection)."""
        if self.sock is not None:
            self.sock.close()
            self.sock = None
            try:
                os.unlink(self.dir / SHIM_SOCKET_NAME)
            except OSError:
                pass
        if self.egress is None:
            self.remove()

    def remove(self) -> None:
        """Remove the directory and what is left in it (the sandbox is gone)."""
        if self.egress is not None:
            self.egress.close()
        shutil.rmtree(self.dir, ignore_errors=True)


class _ShimSocketProtocol(asyncio.Protocol):
    """The shim protocol over the sandbox's socket."""

    def __init__(self, sandbox: DockerSandbox) -> None:
        self._sandbox = sandbox

    def data_received(self, data: bytes) -> None:
        self._sandbox.channel.feed(data)

    def connection_lost(self, exc: Exception | None) -> None:
        self._sandbox.transport_closed()


class _AttachProtocol(asyncio.Protocol):
    """Demultiplexes the attach stream: stderr to the tail, stdout to the shim channel.

    In socket mode the shim closes the fds that pointed to stdout once it has connected,
    and whatever still arrives there (a tool writing to init's stdout) is tool output.
    Before the connection, stdout is an older image's shim saying ready, which the
    protocol check then refuses with a clear message.
    """

    def __init__(self, sandbox: DockerSandbox) -> None:
        self._sandbox = sandbox
        self._buffer = bytearray()

    def data_received(self, data: bytes) -> None:
        buffer = self._buffer
        buffer += data
        offset = 0
        while len(buffer) - offset >= 8:
            stream, size = _FRAME.unpack_from(buffer, offset)
            if len(buffer) - offset - 8 < size:
                break
            payload = bytes(buffer[offset + 8 : offset + 8 + size])
            offset += 8 + size
            if stream == 1 and self._sandbox.shim_transport is None:
                self._sandbox.channel.feed(payload)
            else:
                self._sandbox.stderr_data(payload)
        del buffer[:offset]

    def connection_lost(self, exc: Exception | None) -> None:
        self._sandbox.attach_ended.set()
        self._sandbox.transport_closed()


def _set_reading(transport: asyncio.Transport | None, on: bool) -> None:
    if transport is None or transport.is_closing() or transport.is_reading() == on:
        return
    if on:
        transport.resume_reading()
    else:
        transport.pause_reading()


def exit_message(state: dict[str, Any], memory: str, tail: str) -> str:
    """Why a container ended (the engine's ``State``, empty when it did not answer), in words an agent can act on."""
    code, oom = state.get("ExitCode"), bool(state.get("OOMKilled"))
    if state.get("Running") and not oom:
        message = ("The tool's sandbox closed its protocol connection during the call: a tool must not close "
                   "the shim's file descriptors. The sandbox was stopped.")
    elif oom:
        message = (
            f"The tool ran out of memory: its sandbox is limited to {memory} and was killed. "
            "Process less data at once, stream it, or write it to a file."
        )
    elif not state:
        message = ("The tool's sandbox stopped during the call, and the Docker engine did not say why "
                   "(it may be restarting); the sandbox is replaced once the engine answers again.")
    elif code == 0:
        message = ("The tool's sandbox exited during the call (exit code 0): a tool must return from execute(), "
                   "not call process.exit() or close the shim's file descriptors.")
    elif code == 137:
        message = "The tool's sandbox was killed (SIGKILL) during the call."
    else:
        message = f"The tool's sandbox exited with code {code} during the call."
    if tail and not oom:
        message += f" Its last output:\n{tail}"
    return message


class DockerSandbox(ShimSandbox):
    def __init__(self, container_id: str, user: str, max_line_bytes: int, *,
                 inspect: Callable[[], Awaitable[dict[str, Any]]], memory: str) -> None:
        super().__init__(container_id[:12], user, max_line_bytes)
        self.container_id = container_id
        self._inspect = inspect  # the engine's record of this container
        self._memory = memory  # its limit, for the out-of-memory message
        self.transport: asyncio.Transport | None = None  # the attach stream
        self.shim_transport: asyncio.Transport | None = None  # the shim's socket (socket mode)
        self.attach: Any = None
        self.attach_ended = asyncio.Event()  # the container's output ended: it exited
        self._sockets: _ShimListener | None = None  # its socket directory, kept while egress is served
        self._egress: EgressSession | None = None
        self._egress_accept: asyncio.Task[None] | None = None

    def serve_egress(self, sockets: _ShimListener, session: EgressSession) -> None:
        """Hand each connection to ``egress.sock`` to the proxy's session for this sandbox."""
        assert sockets.egress is not None
        self._sockets, self._egress = sockets, session
        self._egress_accept = asyncio.get_running_loop().create_task(session.serve(sockets.egress, sockets.uid))

    def close_egress(self) -> None:
        """End the sandbox's way out: no new connections, the open ones closed, the socket removed."""
        if self._egress_accept is not None:
            self._egress_accept.cancel()
            self._egress_accept = None
        if self._egress is not None:
            self._egress.close()
            self._egress = None
        if self._sockets is not None:
            self._sockets.remove()
            self._sockets = None

    def _write(self, data: bytes) -> None:
        transport = self.shim_transport or self.transport
        if transport is not None and not transport.is_closing():
            transport.write(data)

    def _reading(self, *, protocol: bool, output: bool) -> None:
        # A paused transport sees no EOF, but destroy closes it regardless, and over the
        # socket transport the attach stream (paused only while its bucket refills) still
        # reports the container's exit.
        if self.shim_transport is not None:
            _set_reading(self.shim_transport, protocol)
            _set_reading(self.transport, output)
        else:  # attach: one stream carries both
            _set_reading(self.transport, protocol and output)

    def close_transports(self) -> None:
        """Close the shim's socket and really close the attach connection.

        For attach, asyncio closing its socket is not enough: the SDK's wrapper holds a
        second reference, so the fd stays open; Docker keeps copying the container's
        output into it, and with nobody reading, `docker rm -f` hangs behind the full
        pipe (a tool flooding its protocol stream showed it).
        """
        if self.shim_transport is not None:
            self.shim_transport.close()
        if self.transport is not None:
            self.transport.close()
        if self.attach is not None:
            attach, self.attach = self.attach, None
            try:
                attach.close()
            except OSError:
                pass

    async def exit_reason(self) -> SandboxFailed:
        # The shim's socket closes the moment node dies; the container's exit (and the
        # engine's record of why: OOM, exit code) follows. Wait for it, briefly.
        try:
            await asyncio.wait_for(self.attach_ended.wait(), EXIT_WAIT_S)
        except TimeoutError:
            pass
        try:
            state = (await self._inspect())["State"]
        except Exception:
            state = {}
        return SandboxFailed(exit_message(state, self._memory, "\n".join(self.stderr_tail)))


class DockerBackend:
    name = "docker"

    def __init__(self, config: SandboxConfig, *, instance: str, max_line_bytes: int,
                 shim_dir: Path | None = None) -> None:
        """``shim_dir`` holds the sandboxes' socket directories (socket transport): a
        directory of this daemon's own that the Docker engine can see at the same path.
        None = a private temporary directory, removed by ``close``."""
        self.config = config
        self.instance = instance
        self.max_line_bytes = max_line_bytes
        self.user = sandbox_user(config.user)
        self._shim_dir = shim_dir
        self._shim_dir_is_temporary = shim_dir is None
        self._shim_dir_ready = False
        self._engine_checked = False  # shim_dir_problem found none on the engine that answered
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
        self.user = sandbox_user(config.user)
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

    # -- the Backend interface ------------------------------------------------

    @property
    def transport(self) -> str:
        return self.config.transport  # for sandboxes started from now on (it may change on reload)

    async def start(self, spec: SandboxSpec) -> DockerSandbox:
        listener = None
        if self.config.transport == "socket":
            if not self._engine_checked:
                problem = await self._shim_transport_problem()
                if problem is not None:
                    raise BackendUnavailable(problem)
            listener = _ShimListener(self.shim_dir(), self.instance, uid=int(self.user.split(":")[0]),
                                     egress=spec.egress is not None)
        try:
            sandbox = await self._start(spec, listener)
        except BaseException:
            if listener is not None:
                listener.remove()
            raise
        finally:
            if listener is not None:
                listener.close()
        if listener is not None and listener.egress is not None and spec.egress is not None:
            sandbox.serve_egress(listener, spec.egress.session(spec.user, sandbox.id, sandbox.egress_context))
        return sandbox

    async def _start(self, spec: SandboxSpec, listener: _ShimListener | None) -> DockerSandbox:
        # The create runs on in its thread even if we are cancelled: wait for it and
        # remove what it made, or shutdown would leave that container behind.
        create = asyncio.ensure_future(self._run(self._create, spec, listener.dir if listener else None))
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
            attach = await self._run(self._attach, container_id, listener is None)
            sandbox = DockerSandbox(container_id, spec.user, self.max_line_bytes, memory=self.config.memory,
                                    inspect=lambda: self._run(lambda: self.api().inspect_container(container_id)))
            sandbox.attach = attach  # the SDK's socket wrapper closes the fd when collected
            loop = asyncio.get_running_loop()
            raw = getattr(attach, "_sock", attach)
            sandbox.transport, _ = await loop.create_connection(lambda: _AttachProtocol(sandbox), sock=raw)
            await self._run(lambda: self.api().start(container_id))
            if listener is not None:
                await self._connect_shim(sandbox, listener)
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

    @staticmethod
    async def _connect_shim(sandbox: DockerSandbox, listener: _ShimListener) -> None:
        """Wait for the shim's one connection, or for the sandbox to end first."""
        accept = asyncio.ensure_future(listener.accept())
        try:
            either: set[asyncio.Future[Any]] = {accept, sandbox.channel.ready}
            await asyncio.wait(either, return_when=asyncio.FIRST_COMPLETED)
        finally:
            if not accept.done():
                accept.cancel()
        if not accept.done() or accept.cancelled():
            # Exited before connecting (raises its reason), or an older image said ready
            # on stdout (the protocol check refuses it).
            await sandbox.channel.ready
            return
        conn = accept.result()
        loop = asyncio.get_running_loop()
        sandbox.shim_transport, _ = await loop.create_connection(lambda: _ShimSocketProtocol(sandbox), sock=conn)

    async def destroy(self, sandbox: DockerSandbox) -> None:
        sandbox.close_egress()
        sandbox.drain()
        sandbox.channel.shutdown()
        sandbox.close_transports()
        await self._remove_quiet(sandbox.container_id)

    async def esbuild(self, directory: Path) -> Esbuild | None:
        if self.config.transport != "socket":
            return None  # attach: the engine may be remote, and cannot be assumed to see the data path
        labels = {LABEL_MANAGED: "1", LABEL_INSTANCE: self.instance}
        return await self._run(lambda: extract_esbuild(self.api(), self.config.image, directory, labels))

    async def preflight(self) -> None:
        if self.config.transport != "socket":
            return
        try:
            problem = await self._shim_transport_problem()
        except BackendUnavailable:
            return  # the engine is away: checked before the first sandbox starts instead
        if problem is not None:
            raise ConfigError(problem)

    async def _shim_transport_problem(self) -> str | None:
        """Why the engine cannot see the shim sockets' directory, or None (then not asked again).
        Raises BackendUnavailable when the engine does not answer."""
        engine = engine_url(self.config)
        if not engine.startswith("unix://"):
            return f"the Docker engine at {engine} is remote and cannot see {self.shim_dir()}; {ATTACH_HINT}"
        info = await self._run(lambda: self.api().info())
        problem = shim_dir_problem(info, self.shim_dir())
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
        cfg = self.config
        uid = self.user.split(":")[0]
        # Checked below the data path without following links; the sandbox uid gets access by ACL.
        try:
            binds, warnings = sandbox_binds(spec, int(uid))
        except OSError as exc:  # not the engine's fault: say what, not "unreachable"
            raise BackendUnavailable(f"cannot prepare the sandbox's folders for {spec.user}: {exc}") from None
        for warning in warnings:
            log.warning("sandbox_mount_access", user=spec.user, problem=warning)
        mounts = [Mount(bind.target, bind.source, type="bind", read_only=bind.read_only) for bind in binds]
        mounts += [Mount(target, str(source), type="bind", read_only=True) for source, target in spec.read_only_mounts]
        # /officer/data is the email database's host folder (in binds): SQLite's journal and WAL go there.
        tmpfs = {"/tmp": f"rw,nosuid,nodev,size={cfg.tmp_size}"}
        environment = sandbox_env(home=CONTAINER_USER, tools_dir=CONTAINER_TOOLS, user_tools_dir=CONTAINER_USER_TOOLS,
                                  email_db=CONTAINER_EMAIL_DB)
        if spec.transpile_cache is not None:
            environment[CACHE_ENV] = CONTAINER_CACHE
        if shim_dir is not None:
            mounts.append(Mount(CONTAINER_SHIM_DIR, str(shim_dir), type="bind", read_only=True))
            environment["SANDBOXD_SHIM_SOCKET"] = f"{CONTAINER_SHIM_DIR}/{SHIM_SOCKET_NAME}"
            if spec.egress is not None:  # the shim routes fetch, http(s) and child processes through it
                environment["SANDBOXD_EGRESS_SOCKET"] = f"{CONTAINER_SHIM_DIR}/{EGRESS_SOCKET_NAME}"
        host_config = self.api().create_host_config(
            mounts=mounts,
            tmpfs=tmpfs,
            read_only=cfg.read_only_root,
            cap_drop=["ALL"],
            cap_add=cfg.cap_add or None,
            security_opt=["no-new-privileges"] if cfg.no_new_privileges else None,
            mem_limit=cfg.memory,
            memswap_limit=cfg.memory,  # no swap: the limit is the limit
            nano_cpus=int(cfg.cpus * 1e9),
            pids_limit=cfg.pids_limit,
            ulimits=[Ulimit(name="core", soft=0, hard=0), Ulimit(name="nofile", soft=4096, hard=4096)],
            init=cfg.init,
            network_mode=self._network(),
            runtime=cfg.runtime,
            ipc_mode="private",
            # Tool output is read over attach; a json-file log would let a flood fill the disk.
            log_config=LogConfig(type=LogConfig.types.NONE),
        )
        try:
            container = self.api().create_container(
                cfg.image,
                name=f"sandboxd-{self.instance[:8]}-{secrets.token_hex(4)}",
                stdin_open=shim_dir is None,  # the protocol's way in, in attach mode only
                tty=False,
                user=self.user,
                environment=environment,
                working_dir=CONTAINER_USER,
                labels={LABEL_MANAGED: "1", LABEL_INSTANCE: self.instance, LABEL_USER: spec.user,
                        LABEL_DATA_PATH: str(spec.root)},
                host_config=host_config,
                network_disabled=cfg.network == "none",
            )
        except docker.errors.APIError as exc:
            # An engine that does not share this host's filesystem (remote behind a unix
            # socket, in a VM) and that `docker info` did not give away.
            if shim_dir is not None and "bind source path does not exist" in str(exc) and str(shim_dir) in str(exc):
                raise BackendUnavailable(
                    f"the Docker engine cannot see {shim_dir.parent} (bind source path does not exist): it does not "
                    f"share this host's filesystem; {ATTACH_HINT}"
                ) from None
            raise
        return container["Id"]

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

    def _attach(self, container_id: str, with_stdin: bool) -> Any:
        # Attach before start with logs=0, so no early output is lost or replayed.
        sock = self.api().attach_socket(
            container_id, params={"stdin": int(with_stdin), "stdout": 1, "stderr": 1, "stream": 1, "logs": 0}
        )
        raw = getattr(sock, "_sock", sock)
        raw.settimeout(None)  # the SDK leaves a 60 s timeout on it
        raw.setblocking(False)
        return sock

    def _remove(self, container_id: str) -> None:
        try:
            self.api().remove_container(container_id, force=True, v=True)
        except docker.errors.NotFound:
            pass

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
