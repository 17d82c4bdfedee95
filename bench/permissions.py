"""What a tool's permissions block costs a warm call (issue 48; docs/tools.md, "Permissions").

Two copies of hello on one daemon, in the same read-write sandbox: one without a block, one
declaring hosts, an env name and ``email: write`` (so both run where a tool without the block
runs, and only the block's own work differs: the call env cut to the declared names, the
network grant made for the proxy). Every call carries the env pi-bridge sends, two names.
Warm calls of each in rounds that take turns, so both share the machine's state.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any, Callable

from bench import daemon as d

REPO = Path(__file__).resolve().parents[1]
BLOCK = 'permissions:\n  network: [api.example.com, "*.example.org"]\n  env: [OFFICER_APIFY_TOKEN]\n  email: write\n'
TOOLS: dict[str, str] = {"hello_undeclared": "", "hello_declared": BLOCK}
ENV = {"OFFICER_APIFY_TOKEN": "apify-bench-token", "PI_SEARXNG_URL": "http://searxng.internal:8080"}


def write_tools(tools: Path) -> None:
    source = REPO / "seed" / "tools" / "hello"
    for name, block in TOOLS.items():
        folder = tools / name
        shutil.copytree(source, folder, dirs_exist_ok=True)
        (folder / "TOOL.md").write_text(f"---\nname: {name}\ndescription: hello.\nversion: 1\ninputs:\n  name:\n"
                                        f"    type: string\n    description: Who to greet.\n{block}---\n\n# {name}\n")


def call_line(user: str, name: str) -> bytes:
    """A tools/call request with the env every call carries, a %d slot for its id."""
    params = json.dumps({"user": user, "name": name, "arguments": {"name": "World"}, "env": ENV}, separators=(",", ":"))
    return b'{"jsonrpc":"2.0","id":%d,"method":"tools/call","params":' + params.replace("%", "%%").encode() + b"}\n"


def permissions_cost(root: Path, run_id: str, image: str, *, calls: int, say: Callable[[str], None]) -> dict[str, Any]:
    daemon = d.BenchDaemon(root, f"pool:\n  min_idle: 0\nsandbox:\n  image: {image}\n", fresh_tools=0)
    write_tools(daemon.data / "tools")
    daemon.start()
    try:
        say(f"permissions: warm calls with a block and without ({calls} each, in turns)")
        user = f"permissions-{run_id}@bench.example"
        return d.calls_in_turns(daemon, {name: call_line(user, name) for name in TOOLS}, calls)
    finally:
        daemon.stop()
