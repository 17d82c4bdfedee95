"""A yardstick for latency on a busy machine: a bare asyncio server in its own process, answering
JSON-RPC lines as the daemon answers ``ping``. Pinged beside the daemon, it takes what the
machine's scheduler adds to any process's answer at that moment (on two cores busy with eight
sandboxes and a download server, milliseconds), which is not a crowd's doing on the daemon's
loop. Used by the noisy-neighbour figures (bench/neighbours.py) and tests
(tests/e2e/neighbours.py)."""

from __future__ import annotations

import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

_SERVER = """
import asyncio, json, sys

async def serve(reader, writer):
    while line := await reader.readline():
        request = json.loads(line)
        writer.write(json.dumps({"jsonrpc": "2.0", "id": request["id"], "result": {}}).encode() + b"\\n")
        await writer.drain()

async def main():
    server = await asyncio.start_unix_server(serve, sys.argv[1])
    print("ready", flush=True)
    await server.serve_forever()

asyncio.run(main())
"""


class Yardstick:
    """The server, running while the context is entered; ``path`` is its socket."""

    def __init__(self) -> None:
        self._dir = tempfile.TemporaryDirectory(prefix="sbd-yardstick-")
        self.path = str(Path(self._dir.name) / "yardstick.sock")
        self._process: subprocess.Popen[str] | None = None

    def __enter__(self) -> Yardstick:
        self._process = subprocess.Popen([sys.executable, "-c", _SERVER, self.path], stdout=subprocess.PIPE, text=True)
        assert self._process.stdout is not None
        if self._process.stdout.readline() != "ready\n":
            raise RuntimeError("the yardstick server did not start")
        return self

    def __exit__(self, *exc: Any) -> None:
        if self._process is not None:
            self._process.kill()
            self._process.wait()
        self._dir.cleanup()
