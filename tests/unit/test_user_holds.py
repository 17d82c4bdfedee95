"""calls/holds.py: a held user's new calls wait for the hold's end; the hold waits for their running calls first."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

import pytest

from sandboxd.server.calls.holds import CallsStillRunning, UserHolds


@dataclass(eq=False)
class Call:
    user: str | None


def test_a_hold_waits_for_running_calls_and_new_calls_wait_for_the_hold() -> None:
    async def scenario() -> list[str]:
        running = {Call("a@example.com"), Call("b@example.com")}
        holds = UserHolds(lambda: running)
        order: list[str] = []

        async def export() -> None:
            async with holds.hold("a@example.com", wait_s=5):
                order.append("hold begins")
                await asyncio.sleep(0.05)
                order.append("hold ends")

        async def finish_running() -> None:
            await asyncio.sleep(0.05)
            order.append("a's running call ends")
            running.discard(next(call for call in running if call.user == "a@example.com"))

        async def new_call(user: str) -> None:
            await asyncio.sleep(0.01)  # after the hold began waiting
            await holds.wait(user)
            order.append(f"{user} starts")

        await asyncio.gather(export(), finish_running(), new_call("a@example.com"), new_call("b@example.com"))
        return order

    assert asyncio.run(scenario()) == ["b@example.com starts", "a's running call ends", "hold begins", "hold ends",
                                       "a@example.com starts"]


def test_a_hold_gives_up_when_calls_still_run_and_releases_the_user() -> None:
    async def scenario() -> bool:
        holds = UserHolds(lambda: [Call("a@example.com")])
        with pytest.raises(CallsStillRunning):
            async with holds.hold("a@example.com", wait_s=0.05):
                pass
        await asyncio.wait_for(holds.wait("a@example.com"), 1)
        return "a@example.com" in holds.held

    assert asyncio.run(scenario()) is False
