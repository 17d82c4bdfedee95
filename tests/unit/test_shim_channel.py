"""The daemon's side of the shim protocol: whatever a sandbox writes, the daemon is not confused."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest

from sandboxd.errors import SandboxFailed
from sandboxd.sandbox.backend import CallRequest
from sandboxd.sandbox.shim import ShimChannel


def line(message: Any) -> bytes:
    return json.dumps(message).encode() + b"\n"


def started_call(max_line: int = 4096) -> tuple[ShimChannel, list[bytes], list[Any], asyncio.Future[dict[str, Any]]]:
    sent: list[bytes] = []
    progress: list[Any] = []
    channel = ShimChannel(sent.append, max_line_bytes=max_line)
    future = channel.call(CallRequest("c1", "/officer/tools/x/index.ts", {"a": 1}), progress.append)
    return channel, sent, progress, future


def test_call_progress_and_result_split_across_reads() -> None:
    async def main() -> None:
        channel, sent, progress, future = started_call()
        request = json.loads(sent[0])
        assert request["method"] == "call" and request["params"]["toolCallId"] == "c1"
        data = line({"jsonrpc": "2.0", "method": "progress", "params": {"id": request["id"], "content": [{"type": "text", "text": "a\u2028b"}]}})
        data += line({"jsonrpc": "2.0", "id": request["id"], "result": {"status": "ok", "content": []}})
        for i in range(0, len(data), 7):  # frames never follow line boundaries
            channel.feed(data[i : i + 7])
        assert progress == [[{"type": "text", "text": "a\u2028b"}]]
        assert (await future)["status"] == "ok"

    asyncio.run(main())


def test_stale_answers_and_odd_params_are_dropped() -> None:
    async def main() -> None:
        channel, sent, progress, future = started_call()
        call_id = json.loads(sent[0])["id"]
        channel.feed(line({"jsonrpc": "2.0", "method": "progress", "params": ["not", "an", "object"]}))
        channel.feed(line({"jsonrpc": "2.0", "method": "progress", "params": {"id": call_id + 1, "content": []}}))
        channel.feed(line({"jsonrpc": "2.0", "id": call_id + 1, "result": {"status": "ok"}}))
        channel.feed(line({"jsonrpc": "2.0", "method": "ready", "params": 5}))
        assert progress == [] and not future.done() and channel.closed is None
        assert await channel.ready == {}

    asyncio.run(main())


@pytest.mark.parametrize("garbage", [b"not json\n", b"[1, 2]\n", b'{"id": NaN, "result": {}}\n'])
def test_protocol_breakage_fails_the_call(garbage: bytes) -> None:
    async def main() -> None:
        channel, _sent, _progress, future = started_call()
        channel.feed(garbage)
        with pytest.raises(SandboxFailed):
            await future
        assert channel.closed is not None

    asyncio.run(main())


def test_an_endless_line_is_cut_off() -> None:
    async def main() -> None:
        channel, _sent, _progress, future = started_call(max_line=1024)
        channel.feed(b"x" * 2000)
        with pytest.raises(SandboxFailed) as info:
            await future
        assert "1024 bytes" in info.value.message

    asyncio.run(main())
