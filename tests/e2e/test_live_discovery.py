"""Discovery is live: a tool added, edited or removed while the daemon runs is seen at the very next call.

No tools/list in between: a call looks its tool up from the last scan, which the kernel's
inotify events (or, where a root cannot be watched, stat calls) say is still current.
"""

from __future__ import annotations

import shutil
from typing import Any

import pytest

from sandboxd.client import RpcError
from tests.e2e.conftest import write_tool
from tests.e2e.hostile_harness import text_of

ECHO_TS = """\
export async function execute(_id: string, params: { q?: string }) {
  return { content: [{ type: "text" as const, text: `mine ${params.q ?? "-"}` }] };
}
"""
USER = "live@example.com"


def test_a_users_tool_added_edited_and_removed_is_seen_at_the_next_call(make_daemon: Any) -> None:
    daemon = make_daemon()
    tools = daemon.user_dir(USER) / "tools"
    with daemon.client() as client:
        assert text_of(client.call_tool(USER, "hello", {"name": "x"}))  # the user's sandbox and scans, before their tool
        with pytest.raises(RpcError, match="unknown tool 'mine'"):
            client.call_tool(USER, "mine", {})
        write_tool(tools, "mine", ECHO_TS)
        assert text_of(client.call_tool(USER, "mine", {})) == "mine -"  # added: called at once
        # Edited: the new TOOL.md's required input is checked at the next call.
        write_tool(tools, "mine", ECHO_TS, inputs="  q:\n    type: string\n    description: Required now.\n", version=2)
        with pytest.raises(RpcError, match='"q" is required'):
            client.call_tool(USER, "mine", {})
        assert text_of(client.call_tool(USER, "mine", {"q": "v2"})) == "mine v2"
        shutil.rmtree(tools / "mine")  # removed: refused at the next call
        with pytest.raises(RpcError, match="unknown tool 'mine'"):
            client.call_tool(USER, "mine", {})
