"""The daemon's CPU floor: the least any asyncio server on this machine spends per warm call.

A bare server in its own process on uvloop (the daemon's loop), answering the bench's warm
``tools/call`` line as the daemon's hot path must at the least: the line parsed as JSON (duplicate
keys refused, as the protocol requires; orjson everywhere else), one
task per request (the daemon's dispatcher makes one, so that a call can be cancelled), the
task awaiting a future that ``call_soon`` resolves (standing for the sandbox's answer), and a
JSON-RPC result line of the daemon's shape written back. With ``--relay`` the future is
instead resolved by a bare Node echo's answer (bench/echo.js, over a unix socket as the daemon
talks to a sandbox's shim): the Docker path's floor, with its second wakeup, write and JSON
decode per call. Their CPU µs and instructions per
request, for the same client loop as the daemon's figures (bench/instructions.py, which samples
its CPU in rounds between the daemon's), say how much of the daemon's cost is its own and how
much any server on this machine would pay.

    python -m bench.cpu_floor SOCKET [--relay]   # the server alone; prints "ready" once it listens
"""

from __future__ import annotations

import asyncio
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, cast

import orjson

from bench import callgrind
from bench.daemon import REPO, sequential_calls
from bench.load import daemon_call_line, process_cpu_split
from bench.wire import LineSocket
from sandboxd import strictjson

USER = "floor@bench.example"
ECHO_JS = Path(__file__).resolve().parent / "echo.js"
# The clock behind /proc/<pid>/stat ticks every 10 ms: at ~50 µs a request, 10,000 keep its rounding under 2%.
MIN_CPU_REQUESTS = 10_000
# orjson wherever the daemon may use it (the answer out, the sandbox's line in); a client's request is
# read by strictjson, which alone refuses duplicate keys, as the protocol requires.
_LINE = orjson.OPT_APPEND_NEWLINE


class _Echo(asyncio.Protocol):
    """The relay's sandbox: a Node echo on the other end of a unix socket, answering requests by id."""

    def __init__(self) -> None:
        self._transport: asyncio.Transport | None = None
        self._buffer = b""
        self._waiting: dict[int, asyncio.Future[dict[str, Any]]] = {}
        self._next_id = 0

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = cast(asyncio.Transport, transport)

    def data_received(self, data: bytes) -> None:
        *lines, self._buffer = (self._buffer + data).split(b"\n")
        for line in lines:
            reply = orjson.loads(line)
            self._waiting.pop(reply["id"]).set_result(reply["result"])

    def call(self, arguments: dict[str, Any]) -> asyncio.Future[dict[str, Any]]:
        assert self._transport is not None
        self._next_id += 1
        answered: asyncio.Future[dict[str, Any]] = asyncio.get_running_loop().create_future()
        self._waiting[self._next_id] = answered
        self._transport.write(orjson.dumps({"jsonrpc": "2.0", "id": self._next_id, "method": "call",
                                            "params": {"arguments": arguments}}, option=_LINE))
        return answered


class _Connection(asyncio.Protocol):
    """One client: lines in, a task per request, one result line out per request."""

    def __init__(self, echo: _Echo | None) -> None:
        self._echo = echo
        self._transport: asyncio.Transport | None = None
        self._buffer = b""
        self._answering: set[asyncio.Task[None]] = set()  # strong references until each is done, as the daemon keeps

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = cast(asyncio.Transport, transport)  # uvloop's transports are only alike

    def data_received(self, data: bytes) -> None:
        *lines, self._buffer = (self._buffer + data).split(b"\n")
        loop = asyncio.get_running_loop()
        for line in lines:
            request = strictjson.loads(line, unique_keys=True)  # as the protocol requires: duplicate keys refused
            task = loop.create_task(self._answer(request["id"], request["params"]["arguments"]))
            self._answering.add(task)
            task.add_done_callback(self._answering.discard)

    async def _answer(self, request_id: Any, arguments: dict[str, Any]) -> None:
        started = time.monotonic()
        if self._echo is not None:
            content = (await self._echo.call(arguments))["content"]
        else:
            loop = asyncio.get_running_loop()
            answered: asyncio.Future[str] = loop.create_future()
            loop.call_soon(answered.set_result, f"Hello, {arguments['name']}!")  # the sandbox's answer, a loop turn later
            content = [{"type": "text", "text": await answered}]
        result = {"content": content, "isError": False, "status": "ok",
                  "durationMs": round((time.monotonic() - started) * 1000)}
        if self._transport is not None and not self._transport.is_closing():
            self._transport.write(orjson.dumps({"jsonrpc": "2.0", "id": request_id, "result": result}, option=_LINE))


async def _serve(path: str, relay: bool) -> None:
    loop = asyncio.get_running_loop()
    echo = None
    if relay:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        # Node's stdin and stdout are the other end: it exits at EOF, when this process goes.
        subprocess.Popen(["node", str(ECHO_JS)], stdin=theirs.fileno(), stdout=theirs.fileno())
        theirs.close()
        _, echo = await loop.connect_accepted_socket(_Echo, ours)
    server = await loop.create_unix_server(lambda: _Connection(echo), path)
    print("ready", flush=True)
    await server.serve_forever()


class FloorServer:
    """The server in a process of its own while the context is entered (``command_prefix``: e.g. valgrind's)."""

    def __init__(self, command_prefix: list[str] | None = None, environ: dict[str, str] | None = None, *,
                 relay: bool = False) -> None:
        self._dir = tempfile.TemporaryDirectory(prefix="sbd-cpu-floor-")
        self.path = str(Path(self._dir.name) / "floor.sock")
        self._command = [*(command_prefix or []), sys.executable, "-m", "bench.cpu_floor", self.path,
                         *(["--relay"] if relay else [])]
        self._environ = environ or {}
        self._process: subprocess.Popen[str] | None = None

    @property
    def pid(self) -> int:
        assert self._process is not None
        return self._process.pid

    def __enter__(self) -> FloorServer:
        self._process = subprocess.Popen(self._command, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                                         cwd=REPO, env={**os.environ, **self._environ})
        assert self._process.stdout is not None
        if self._process.stdout.readline() != "ready\n":
            self.__exit__()
            raise RuntimeError(f"the CPU floor's server did not start ({' '.join(self._command)}): "
                               f"run `python -m bench.cpu_floor /tmp/floor.sock` to see why")
        return self

    def __exit__(self, *exc: Any) -> None:
        if self._process is not None:
            self._process.terminate()
            try:
                self._process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self._process.kill()
                self._process.wait()
        self._dir.cleanup()


class CpuFloor:
    """The server (not under valgrind) and a warm connection to it, for CPU samples taken between the daemon's."""

    def __init__(self, warmup: int = 500, *, relay: bool = False) -> None:
        self._warmup = warmup
        self._server = FloorServer(relay=relay)
        self._conn: LineSocket | None = None
        self._next_id = 1

    def __enter__(self) -> CpuFloor:
        self._server.__enter__()
        try:
            self._conn = LineSocket(self._server.path)
            self.cpu_seconds(self._warmup)  # the server's first requests build what every later one reuses
        except BaseException:
            self.__exit__()
            raise
        return self

    def cpu_seconds(self, requests: int) -> tuple[float, float]:
        """The server's user and system CPU seconds for ``requests`` back-to-back requests, as the daemon's calls are timed."""
        assert self._conn is not None
        user0, system0 = process_cpu_split(self._server.pid)
        sequential_calls(self._conn, daemon_call_line(USER), requests, first_id=self._next_id)
        self._next_id += requests
        user1, system1 = process_cpu_split(self._server.pid)
        return user1 - user0, system1 - system0

    def __exit__(self, *exc: Any) -> None:
        if self._conn is not None:
            self._conn.close()
        self._server.__exit__()


def count(requests: int, warmup: int, *, relay: bool = False) -> dict[str, Any]:
    """Instructions the server executes per request (idle taken out), under callgrind, as the daemon's are counted."""
    out_dir = Path(tempfile.mkdtemp(prefix="sbd-callgrind-floor-"))
    with FloorServer(callgrind.callgrind_prefix(out_dir), environ={"PYTHONHASHSEED": "0"}, relay=relay) as server:
        conn = LineSocket(server.path)
        try:
            template = daemon_call_line(USER)
            sequential_calls(conn, template, warmup)
            window_s = callgrind.counted_window(
                server.pid, lambda: sequential_calls(conn, template, requests, first_id=warmup + 1))
        finally:
            conn.close()
    return callgrind.per_call_counts(out_dir, requests, window_s)


if __name__ == "__main__":
    import uvloop

    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        runner.run(_serve(sys.argv[1], relay="--relay" in sys.argv[2:]))
