"""tools/watch: who is told which change (the daemon e2e and `sandboxd mcp` e2e prove it end to end)."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

from sandboxd.errors import InvalidParams
from sandboxd.server.watch import MAX_WATCHES_PER_CONNECTION, ToolWatch
from sandboxd.tools.discovery import ToolCatalog

ALICE, BOB = "alice@example.com", "bob@example.com"


def write_tool(root: Path, name: str, description: str = "A tool.") -> None:
    tool = root / name
    tool.mkdir(parents=True, exist_ok=True)
    (tool / "TOOL.md").write_text(f"---\nname: {name}\ndescription: {description}\nversion: 1\n---\n# {name}\n")
    (tool / "index.ts").write_text("export async function execute() {}\n")


class Inbox:
    def __init__(self) -> None:
        self.messages: list[dict[str, Any]] = []

    def __call__(self, message: dict[str, Any]) -> None:
        self.messages.append(message)

    def users(self) -> list[str | None]:
        assert all(m["method"] == "notifications/tools/list_changed" for m in self.messages)
        users = [m["params"].get("user") for m in self.messages]
        self.messages.clear()
        return users


def test_each_watcher_hears_of_its_users_changes_and_the_global_ones(tmp_path: Path) -> None:
    write_tool(tmp_path / "tools", "hello")

    async def scenario() -> None:
        watch = ToolWatch(ToolCatalog(tmp_path))
        alice, bob = Inbox(), Inbox()
        assert await watch.watch("conn-a", alice, {"user": ALICE}) == {}
        await watch.watch("conn-b", bob, {"user": BOB})
        await watch.check()
        assert alice.users() == [] and bob.users() == []  # nothing changed since the watch

        write_tool(tmp_path / ALICE / "tools", "mine")  # the user's tools folder appears
        await watch.check()
        assert alice.users() == [ALICE] and bob.users() == []

        (tmp_path / ALICE / "tools" / "mine" / "TOOL.md").write_text(
            "---\nname: mine\ndescription: Edited in place.\nversion: 2\n---\n# mine\n")
        await watch.check()
        assert alice.users() == [ALICE]

        write_tool(tmp_path / "tools", "added")  # global: everyone's list changes
        await watch.check()
        assert alice.users() == [ALICE] and bob.users() == [BOB]

        watch.forget("conn-a")  # its connection closed
        write_tool(tmp_path / "tools", "another")
        await watch.check()
        assert alice.users() == [] and bob.users() == [BOB]

    asyncio.run(scenario())


def test_a_change_right_after_the_watch_is_answered_is_told(tmp_path: Path) -> None:
    async def scenario() -> None:
        watch = ToolWatch(ToolCatalog(tmp_path))
        inbox = Inbox()
        await watch.watch("conn", inbox, {"user": ALICE})  # the baseline is taken before the answer
        write_tool(tmp_path / ALICE / "tools", "quick")
        await watch.check()
        assert inbox.users() == [ALICE]

    asyncio.run(scenario())


def test_watch_params_are_checked_and_bounded(tmp_path: Path) -> None:
    async def scenario() -> None:
        watch = ToolWatch(ToolCatalog(tmp_path))
        with pytest.raises(InvalidParams, match="must be an object"):
            await watch.watch("conn", Inbox(), ["alice@example.com"])
        with pytest.raises(InvalidParams):
            await watch.watch("conn", Inbox(), {"user": "../etc"})
        for n in range(MAX_WATCHES_PER_CONNECTION):
            await watch.watch("conn", Inbox(), {"user": f"u{n}@example.com"})
        await watch.watch("conn", Inbox(), {"user": "u0@example.com"})  # again: no new watch
        with pytest.raises(InvalidParams, match=f"at most {MAX_WATCHES_PER_CONNECTION}"):
            await watch.watch("conn", Inbox(), {"user": "one-more@example.com"})
        assert await watch.watch("other", Inbox(), None) == {}  # the global tools alone

    asyncio.run(scenario())
