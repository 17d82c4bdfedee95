"""The official MCP SDK's client against `sandboxd mcp`, over stdio (a child process) or streamable HTTP."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any, AsyncIterator

import httpx2
from mcp import Client
from mcp.client.stdio import StdioServerParameters, stdio_client
from mcp.client.streamable_http import streamable_http_client

from tests.e2e.conftest import REPO, Daemon

USER = "mcp@example.com"
ERAS = ["legacy", "2026-07-28"]  # the initialize handshake (2025-11-25), and the per-request envelope
TOKEN = "t0ken-for-tests-" + "0123456789abcdef" * 2


def server_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """This machine's environment without SANDBOXD_* (which would change what runs), plus ``extra``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("SANDBOXD_")}
    return {**env, **(extra or {})}


def mcp_command(daemon: Daemon, *args: str, user: str = USER) -> list[str]:
    return [sys.executable, "-m", "sandboxd", "mcp", "--user", user, "--socket", str(daemon.socket),
            "--config", str(daemon.config_path), *args]


@asynccontextmanager
async def stdio_session(daemon: Daemon, mode: str, *args: str, env: dict[str, str] | None = None,
                        errlog: Path | None = None, **client: Any) -> AsyncIterator[Client]:
    command = mcp_command(daemon, *args)
    params = StdioServerParameters(command=command[0], args=command[1:], env=server_env(env), cwd=str(REPO))
    with open(errlog or daemon.tmp / "mcp-stderr.log", "a") as log:
        async with Client(stdio_client(params, errlog=log), mode=mode, **client) as session:
            yield session


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class HttpServer:
    """`sandboxd mcp --http 127.0.0.1:PORT` as a child process; ``nofile``: under ``prlimit --nofile``."""

    def __init__(self, daemon: Daemon, *args: str, env: dict[str, str] | None = None, nofile: int | None = None) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}/mcp"
        self.log = daemon.tmp / f"mcp-http-{self.port}.log"
        limit = ["prlimit", f"--nofile={nofile}:{nofile}", "--"] if nofile is not None else []
        self.proc = subprocess.Popen([*limit, *mcp_command(daemon, "--http", f"127.0.0.1:{self.port}", *args)],
                                     env=server_env({"SANDBOXD_MCP_TOKEN": TOKEN, **(env or {})}), cwd=REPO,
                                     stdout=subprocess.DEVNULL, stderr=open(self.log, "ab"))
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, f"sandboxd mcp --http exited:\n{self.log.read_text()}"
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=1).close()
                return
            except OSError:
                time.sleep(0.1)
        raise AssertionError(f"sandboxd mcp --http did not listen:\n{self.log.read_text()}")

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()

    @asynccontextmanager
    async def session(self, mode: str, token: str = TOKEN, **client: Any) -> AsyncIterator[Client]:
        async with httpx2.AsyncClient(headers={"Authorization": f"Bearer {token}"},
                                      timeout=httpx2.Timeout(30, read=300)) as http:
            async with Client(streamable_http_client(self.url, http_client=http), mode=mode, **client) as session:
                yield session


def text_of(result: Any) -> str:
    return "\n".join(block.text for block in result.content if block.type == "text")


def abort_marker_tool(daemon: Daemon, user: str = USER) -> Path:
    """A user tool that, when its AbortSignal fires, writes the reason into the user's folder (seen from the host)."""
    tool = daemon.user_dir(user) / "tools" / "abort_marker"
    tool.mkdir(parents=True, exist_ok=True)
    (tool / "TOOL.md").write_text("---\nname: abort_marker\ndescription: Waits, and notes the abort.\nversion: 1\n"
                                  "inputs:\n  tag:\n    type: string\n    description: Names the marker file.\n---\n"
                                  "# abort_marker\n")
    (tool / "index.ts").write_text(
        "import { writeFileSync } from 'node:fs';\n"
        "export async function execute(_id: string, params: { tag: string }, signal?: AbortSignal) {\n"
        "  await new Promise<void>((resolve) => {\n"
        "    const timer = setTimeout(resolve, 30000);\n"
        "    signal?.addEventListener('abort', () => {\n"
        "      writeFileSync(`/officer/user/aborted-${params.tag}.txt`, String(signal.reason));\n"
        "      clearTimeout(timer); resolve();\n"
        "    });\n"
        "  });\n"
        "  return { content: [{ type: 'text', text: 'finished' }] };\n"
        "}\n")
    return daemon.user_dir(user)

