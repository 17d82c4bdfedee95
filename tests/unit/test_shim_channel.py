"""The daemon's side of the shim protocol: whatever a sandbox writes, the daemon is not confused."""

from __future__ import annotations

import asyncio
import io
import json
import time
from pathlib import Path
from typing import Any

import pytest

from sandboxd.errors import SandboxFailed
from sandboxd.logging import configure_logging, secret_values
from sandboxd.sandbox.backend import CallGuard, CallRequest, OutputLimits, SandboxSpec
from sandboxd.sandbox.process_backend import ProcessBackend
from sandboxd.sandbox.shim import ShimChannel, ShimSandbox


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


def test_a_healthy_shims_conversation_never_breaks_the_sandbox() -> None:
    async def main() -> None:
        broken: list[SandboxFailed] = []
        sent: list[bytes] = []
        progress: list[Any] = []
        channel = ShimChannel(sent.append, max_line_bytes=4096, on_broken=broken.append)
        channel.feed(line({"jsonrpc": "2.0", "method": "ready", "params": {"protocol": 2}}))
        for n in range(3):
            future = channel.call(CallRequest(f"c{n}", "/officer/tools/x/index.ts", {}), progress.append)
            call_id = json.loads(sent[-1])["id"]
            channel.feed(line({"jsonrpc": "2.0", "method": "progress", "params": {"id": call_id, "content": []}}))
            channel.feed(line({"jsonrpc": "2.0", "id": call_id, "result": {"status": "ok", "content": []}}))
            assert (await future)["status"] == "ok"
        assert broken == [] and channel.closed is None and len(progress) == 3

    asyncio.run(main())


def test_late_words_for_a_call_the_daemon_gave_up_on_are_dropped() -> None:
    async def main() -> None:
        channel, sent, progress, future = started_call()
        call_id = json.loads(sent[0])["id"]
        future.set_exception(SandboxFailed("deadline"))  # what CallRunner does at the deadline
        future.exception()
        channel.feed(line({"jsonrpc": "2.0", "method": "progress", "params": {"id": call_id, "content": []}}))
        channel.feed(line({"jsonrpc": "2.0", "id": call_id, "result": {"status": "ok"}}))
        assert progress == [] and channel.closed is None

    asyncio.run(main())


STRAY = [
    {"jsonrpc": "2.0", "method": "progress", "params": ["not", "an", "object"]},
    {"jsonrpc": "2.0", "method": "progress", "params": {"id": 99, "content": []}},
    {"jsonrpc": "2.0", "id": 99, "result": {"status": "ok", "content": []}},
    {"jsonrpc": "2.0", "method": "ready", "params": {"protocol": 2}},  # a second ready
    {"jsonrpc": "2.0", "method": "log", "params": {}},
    {"jsonrpc": "2.0", "id": None, "error": {"code": -32603, "message": "x"}},
]


@pytest.mark.parametrize("stray", STRAY)
def test_a_message_about_another_call_breaks_the_sandbox(stray: dict[str, Any]) -> None:
    async def main() -> None:
        broken: list[SandboxFailed] = []
        sent: list[bytes] = []
        channel = ShimChannel(sent.append, max_line_bytes=4096, on_broken=broken.append)
        channel.feed(line({"jsonrpc": "2.0", "method": "ready", "params": {}}))
        future = channel.call(CallRequest("c1", "/officer/tools/x/index.ts", {}), lambda _c: None)
        channel.feed(line(stray))
        with pytest.raises(SandboxFailed, match="not about the running call"):
            await future
        assert broken and broken[0] is channel.closed

    asyncio.run(main())


@pytest.mark.parametrize("stray", STRAY + [{"jsonrpc": "2.0", "id": 1, "result": {"status": "ok", "content": []}}])
def test_anything_while_no_call_runs_breaks_the_sandbox(stray: dict[str, Any]) -> None:
    async def main() -> None:
        broken: list[SandboxFailed] = []
        sent: list[bytes] = []
        channel = ShimChannel(sent.append, max_line_bytes=4096, on_broken=broken.append)
        channel.feed(line({"jsonrpc": "2.0", "method": "ready", "params": {}}))
        future = channel.call(CallRequest("c1", "/officer/tools/x/index.ts", {}), lambda _c: None)
        channel.feed(line({"jsonrpc": "2.0", "id": 1, "result": {"status": "ok", "content": []}}))
        await future
        channel.feed(line(stray))  # a forged line, or a second answer to call 1
        assert len(broken) == 1 and "while no call was running" in broken[0].message
        later = channel.call(CallRequest("c2", "/officer/tools/x/index.ts", {}), lambda _c: None)
        with pytest.raises(SandboxFailed):
            await later

    asyncio.run(main())


# Answers to the running call (id 1) that are not JSON as RFC 8259 has it: each would settle the call if read.
_NOT_JSON = [b'{"jsonrpc":"2.0","id":1,"result":{"n":%b}}\n' % value for value in (
    b"NaN", b"Infinity", b"-Infinity", b"1e400", b'"\xff"', b'"\xed\xa0\x80"', b"[" * 2000 + b"]" * 2000)]


@pytest.mark.parametrize("garbage", [b"not json\n", b"[1, 2]\n", b'{"id": NaN, "result": {}}\n',
                                     b'\xef\xbb\xbf{"jsonrpc":"2.0","id":1,"result":{}}\n', *_NOT_JSON])
def test_protocol_breakage_fails_the_call(garbage: bytes) -> None:
    async def main() -> None:
        channel, _sent, _progress, future = started_call()
        channel.feed(garbage)
        with pytest.raises(SandboxFailed):
            await future
        assert channel.closed is not None

    asyncio.run(main())


def test_an_escaped_lone_surrogate_in_a_result_is_read_as_before() -> None:
    # orjson refuses it; the channel then asks strictjson, which reads it (the client gets it escaped).
    async def main() -> None:
        channel, _sent, _progress, future = started_call()
        channel.feed(b'{"jsonrpc":"2.0","id":1,"result":{"status":"ok","content":[{"type":"text","text":"a\\ud800"}]}}\n')
        assert (await future)["content"][0]["text"] == "a\ud800"
        assert channel.closed is None

    asyncio.run(main())


def test_an_endless_line_is_cut_off() -> None:
    async def main() -> None:
        channel, _sent, _progress, future = started_call(max_line=1024)
        channel.feed(b"x" * 2000)
        with pytest.raises(SandboxFailed) as info:
            await future
        assert "1024 bytes" in info.value.message

    asyncio.run(main())


def test_an_over_long_line_is_refused_even_when_it_arrives_whole() -> None:
    # A forged result past the limit must not pass because it came in one read.
    async def main() -> None:
        channel, sent, _progress, future = started_call(max_line=1024)
        request_id = json.loads(sent[0])["id"]
        answer = {"jsonrpc": "2.0", "id": request_id, "result": {"status": "ok", "content": [], "pad": "x" * 2000}}
        channel.feed(line(answer))
        with pytest.raises(SandboxFailed) as info:
            await future
        assert "1024 bytes" in info.value.message

    asyncio.run(main())


# -- ShimSandbox: output budgets, reading, masking ------------------------------------------


class RecordingSandbox(ShimSandbox):
    """A ShimSandbox whose transports are lists: what it was told to write and to read."""

    def __init__(self) -> None:
        super().__init__("sb-1", "alice@example.com", 4096)
        self.sent: list[bytes] = []
        self.reading: list[tuple[bool, bool]] = []

    def _write(self, data: bytes) -> None:
        self.sent.append(data)

    def _reading(self, *, protocol: bool, output: bool) -> None:
        self.reading.append((protocol, output))

    async def exit_reason(self) -> SandboxFailed:
        return SandboxFailed("exited")

    def start_call(self, limits: OutputLimits, secrets: frozenset[str] = frozenset()) -> asyncio.Future[dict[str, Any]]:
        self.channel.feed(line({"jsonrpc": "2.0", "method": "ready", "params": {}}))
        return self.call(CallRequest("c1", "/officer/tools/x/index.ts", {}), lambda _c: None,
                         CallGuard(output_limits=limits, secrets=secrets))

    def answer(self) -> None:
        call_id = json.loads(self.sent[-1])["id"]
        self.channel.feed(line({"jsonrpc": "2.0", "id": call_id, "result": {"status": "ok", "content": []}}))


BIG = OutputLimits(output_rate_bytes=1 << 30, output_burst_bytes=1 << 30, idle_output_bytes=8192)


def test_an_idle_sandbox_that_keeps_writing_is_reported_dead() -> None:
    async def main() -> None:
        sandbox = RecordingSandbox()
        died: list[bool] = []
        sandbox.on_exit(lambda: died.append(True))
        future = sandbox.start_call(BIG)
        sandbox.stderr_data(b"x" * 100_000 + b"\n")  # during the call: any amount within the rate
        sandbox.answer()
        await future
        sandbox.stderr_data(b"[c1 (finished)] a late line\n" * 100)  # under the idle allowance
        assert sandbox.alive and not died
        sandbox.stderr_data(b"y" * 8192)
        assert not sandbox.alive and died == [True]
        assert "calls.idle_output_bytes" in (sandbox.channel.closed.message if sandbox.channel.closed else "")
        sandbox.stderr_data(b"z" * 8192)
        assert died == [True]  # told once

    asyncio.run(main())


def test_output_past_the_burst_pauses_reading_until_the_bucket_refills() -> None:
    async def main() -> None:
        sandbox = RecordingSandbox()
        limits = OutputLimits(output_rate_bytes=100_000, output_burst_bytes=10_000, idle_output_bytes=1 << 20)
        sandbox.start_call(limits)
        sandbox.stderr_data(b"x" * 10_000)
        assert sandbox.reading == []  # the burst
        sandbox.stderr_data(b"x" * 5_000)  # 5,000 in debt: 50 ms at 100,000/s
        assert sandbox.reading == [(True, False)]
        started = time.monotonic()
        while sandbox.reading[-1] != (True, True):
            await asyncio.sleep(0.005)
        assert time.monotonic() - started >= 0.03
        assert sandbox.alive

    asyncio.run(main())


def test_the_clients_pause_stops_the_protocol_stream_only() -> None:
    async def main() -> None:
        sandbox = RecordingSandbox()
        sandbox.start_call(BIG)
        sandbox.pause_reading()
        sandbox.resume_reading()
        assert sandbox.reading == [(False, True), (True, True)]

    asyncio.run(main())


def test_a_sandbox_being_destroyed_is_read_to_its_end_whatever_asks() -> None:
    async def main() -> None:
        sandbox = RecordingSandbox()
        sandbox.start_call(OutputLimits(output_rate_bytes=1024, output_burst_bytes=1024, idle_output_bytes=1 << 20))
        sandbox.stderr_data(b"x" * 4096)  # the bucket is empty: output paused
        sandbox.pause_reading()  # and the client reads no more
        assert sandbox.reading[-1] == (False, False)
        sandbox.drain()
        sandbox.pause_reading()
        sandbox.stderr_data(b"x" * 4096)
        assert sandbox.reading[-2:] == [(True, True), (True, True)]  # a paused stream would hide its end

    asyncio.run(main())


def test_tool_output_is_logged_masked_with_every_call_secret(tmp_path: Any) -> None:
    async def main() -> str:
        stream = io.StringIO()
        configure_logging("debug", "json", stream)
        sandbox = RecordingSandbox()
        # A call's secrets come with its request (the runner's secret_values yields them).
        with secret_values(["tok-first-call"]) as secrets:
            future = sandbox.start_call(BIG, secrets)
        sandbox.stderr_data(b"[c1] my token is tok-first-call\n")  # arrives outside the call's context
        sandbox.answer()
        await future
        sandbox.call(CallRequest("c2", "/officer/tools/x/index.ts", {}), lambda _c: None,
                     CallGuard(output_limits=BIG, secrets=frozenset({"tok-second-call"})))
        sandbox.stderr_data(b"[c1 (finished)] a timer: tok-first-call, tok-second-call\n")
        return stream.getvalue()

    logged = asyncio.run(main())
    configure_logging("info", "json", io.StringIO())
    assert "tok-first-call" not in logged and "tok-second-call" not in logged
    assert logged.count("***") == 3, logged


def test_the_process_backend_slows_a_flooding_tool_to_the_rate(tmp_path: Path) -> None:
    # The one real-node test here: the process backend's pumps honour _reading. 2 MiB past a
    # 256 KiB burst at 1 MiB/s take at least (2 - 0.25 - what the pipes hold) s; unthrottled, milliseconds.
    tool = tmp_path / "tools" / "flood"
    tool.mkdir(parents=True)
    (tool / "index.ts").write_text(
        "export async function execute() {\n"
        "  const chunk = ('x'.repeat(1023) + '\\n').repeat(64);\n"
        "  const started = Date.now();\n"
        "  for (let i = 0; i < 32; i++) process.stderr.write(chunk);\n"
        "  return { content: [{ type: 'text', text: String(Date.now() - started) }] };\n"
        "}\n")
    limits = OutputLimits(output_rate_bytes=1 << 20, output_burst_bytes=256 << 10, idle_output_bytes=1 << 20)

    async def main() -> int:
        backend = ProcessBackend(max_line_bytes=1 << 20)
        spec = SandboxSpec("alice@example.com", tmp_path / "tools", tmp_path / "user", tmp_path / "user" / "tools", None)
        sandbox = await backend.start(spec)
        try:
            request = CallRequest("c1", str(tool / "index.ts"), {})
            result = await asyncio.wait_for(sandbox.call(request, lambda _c: None, CallGuard(output_limits=limits)), 30)
            assert sandbox.alive
            return int(result["content"][0]["text"])
        finally:
            # Destroy drains the paused pipes: without that, wait() never returns.
            await asyncio.wait_for(backend.close(), 30)

    assert asyncio.run(main()) >= 1000
