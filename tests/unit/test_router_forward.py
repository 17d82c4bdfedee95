"""The router's forwarding rules against scripted hosts on unix sockets: a refusal retried as the rules say,
a call that may have run never sent twice, a cancel and a progress stream that follow their call."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any, Awaitable, Callable

import pytest

from sandboxd.cluster.records import NodeRecord, UserRecord
from sandboxd.errors import NotServedHere
from sandboxd.router.forward import Forward, Hosts, NotSent, Sending, routed
from sandboxd.router.ids import Verbatim, verbatim_answer
from sandboxd.router.server import _result, _rewrite
from sandboxd.router.upstream import UpstreamLost, unix_dial
from sandboxd.wire import PROGRESS, encode, error_object, error_response, notification, request, response
from tests.unit.router_view import View

USER = "alice@example.com"
Script = Callable[[dict[str, Any], asyncio.StreamWriter], Awaitable[None]]


class FakeHost:
    """A host that answers every request with ``script``; ``seen`` is every message it read."""

    def __init__(self, path: Path, script: Script) -> None:
        self.path, self.script = path, script
        self.seen: list[dict[str, Any]] = []

    async def start(self) -> FakeHost:
        self.server = await asyncio.start_unix_server(self._serve, str(self.path))
        return self

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while line := await reader.readline():
            message = json.loads(line)
            self.seen.append(message)
            await self.script(message, writer)

    def calls(self) -> list[dict[str, Any]]:
        return [message for message in self.seen if message.get("method") == "tools/call"]


async def ok(message: dict[str, Any], writer: asyncio.StreamWriter) -> None:
    if "id" in message:
        writer.write(encode(response(message["id"], {"status": "ok", "served": "ok"})))


def refusing(reason: str, **data: Any) -> Script:
    async def refuse(message: dict[str, Any], writer: asyncio.StreamWriter) -> None:
        writer.write(encode(error_response(message["id"], error_object(-32005, reason, {"reason": reason, **data}))))
    return refuse


def run(short_dir: Path, scripts: dict[str, Script], scenario: Callable[..., Awaitable[None]]) -> None:
    async def main() -> None:
        view = View()
        hosts = {name: await FakeHost(short_dir / f"{name}.sock", script).start() for name, script in scripts.items()}
        for name, host in hosts.items():
            view.hosts[name] = NodeRecord(name, str(host.path))
        upstreams = Hosts(unix_dial, lambda _node, _message: None, lambda _conn: None)
        try:
            await scenario(view, hosts, upstreams)
        finally:
            upstreams.close()
            for host in hosts.values():
                host.server.close()
    asyncio.run(main())


def call(deadline_s: float = 5.0, **kwargs: Any) -> Sending:
    return Sending("tools/call", {"user": USER, "name": "hello"}, deadline_s=deadline_s, wait_s=10, **kwargs)


def test_a_new_user_is_claimed_then_served(short_dir: Path) -> None:
    async def scenario(view: View, hosts: dict[str, FakeHost], upstreams: Hosts) -> None:
        answer = await routed(USER, call(), view, upstreams)
        assert answer["result"]["status"] == "ok"
        home = view.users[USER].node
        assert len(hosts[home].calls()) == 1 and sum(len(host.calls()) for host in hosts.values()) == 1

    run(short_dir, {"a": ok, "b": ok}, scenario)


def test_elsewhere_is_retried_once_at_the_named_host(short_dir: Path) -> None:
    async def scenario(view: View, hosts: dict[str, FakeHost], upstreams: Hosts) -> None:
        view.users[USER] = UserRecord(USER, "a", 1)  # stale: b holds the user
        hosts["a"].script = refusing("elsewhere", node="b", address=str(hosts["b"].path))
        answer = await routed(USER, call(), view, upstreams)
        assert answer["result"]["served"] == "ok"
        assert (len(hosts["a"].calls()), len(hosts["b"].calls())) == (1, 1)

    run(short_dir, {"a": ok, "b": ok}, scenario)


def test_a_second_elsewhere_is_answered_not_followed(short_dir: Path) -> None:
    async def scenario(view: View, hosts: dict[str, FakeHost], upstreams: Hosts) -> None:
        view.users[USER] = UserRecord(USER, "a", 1)
        hosts["a"].script = refusing("elsewhere", node="b", address=str(hosts["b"].path))
        hosts["b"].script = refusing("elsewhere", node="a", address=str(hosts["a"].path))
        answer = await routed(USER, call(), view, upstreams)
        assert answer["error"]["data"]["reason"] == "elsewhere"
        assert (len(hosts["a"].calls()), len(hosts["b"].calls())) == (1, 1)

    run(short_dir, {"a": ok, "b": ok}, scenario)


def test_a_call_whose_connection_dies_is_never_sent_again(short_dir: Path) -> None:
    async def die(message: dict[str, Any], writer: asyncio.StreamWriter) -> None:
        writer.close()

    async def scenario(view: View, hosts: dict[str, FakeHost], upstreams: Hosts) -> None:
        view.users[USER] = UserRecord(USER, "a", 1)
        with pytest.raises(UpstreamLost, match="may have run"):
            await routed(USER, call(), view, upstreams)
        await asyncio.sleep(0.1)
        assert len(hosts["a"].calls()) == 1 and not hosts["b"].calls()

    run(short_dir, {"a": die, "b": ok}, scenario)


def test_moving_waits_for_the_view_then_goes_to_the_new_home(short_dir: Path) -> None:
    async def scenario(view: View, hosts: dict[str, FakeHost], upstreams: Hosts) -> None:
        view.users[USER] = UserRecord(USER, "a", 1, "moving", "b")
        routing = asyncio.ensure_future(routed(USER, call(), view, upstreams))
        await asyncio.sleep(0.3)
        assert not routing.done() and not hosts["a"].calls()
        view.put(USER, UserRecord(USER, "b", 2))
        answer = await asyncio.wait_for(routing, 2)
        assert answer["result"]["status"] == "ok" and len(hosts["b"].calls()) == 1 and not hosts["a"].calls()

    run(short_dir, {"a": ok, "b": ok}, scenario)


def test_moving_past_the_calls_deadline_is_answered_moving(short_dir: Path) -> None:
    async def scenario(view: View, hosts: dict[str, FakeHost], upstreams: Hosts) -> None:
        view.users[USER] = UserRecord(USER, "a", 1)
        hosts["a"].script = refusing("moving", retry_after_ms=1000)  # the view has not seen the move yet
        started = asyncio.get_running_loop().time()
        with pytest.raises(NotServedHere) as refused:
            await routed(USER, call(deadline_s=0.6), view, upstreams)
        assert refused.value.reason == "moving"
        assert 0.5 <= asyncio.get_running_loop().time() - started < 3
        assert len(hosts["a"].calls()) >= 2  # asked again as the view was looked at again: a refusal ran nothing

    run(short_dir, {"a": ok}, scenario)


def test_a_cancel_follows_the_call_to_its_host(short_dir: Path) -> None:
    async def hold(message: dict[str, Any], writer: asyncio.StreamWriter) -> None:
        if message.get("method") == "notifications/cancelled":
            request_id = message["params"]["requestId"]
            writer.write(encode(response(request_id, {"status": "cancelled"})))

    async def scenario(view: View, hosts: dict[str, FakeHost], upstreams: Hosts) -> None:
        view.users[USER] = UserRecord(USER, "a", 1)
        forward = Forward()
        routing = asyncio.ensure_future(routed(USER, call(forward=forward), view, upstreams))
        while not hosts["a"].calls():
            await asyncio.sleep(0.01)
        forward.cancel("stop")
        answer = await asyncio.wait_for(routing, 2)
        assert answer["result"]["status"] == "cancelled"
        cancel = hosts["a"].seen[-1]
        assert cancel["params"] == {"requestId": hosts["a"].calls()[0]["id"], "reason": "stop"}

    run(short_dir, {"a": hold}, scenario)


def test_a_cancel_before_a_host_is_reached_sends_nothing(short_dir: Path) -> None:
    async def scenario(view: View, hosts: dict[str, FakeHost], upstreams: Hosts) -> None:
        view.users[USER] = UserRecord(USER, "a", 1, "moving", "b")
        forward = Forward()
        routing = asyncio.ensure_future(routed(USER, call(forward=forward), view, upstreams))
        await asyncio.sleep(0.05)
        forward.cancel("stop")
        with pytest.raises(NotSent):
            await asyncio.wait_for(routing, 0.2)  # at once, not at the next look at the view
        assert not hosts["a"].seen

    run(short_dir, {"a": ok}, scenario)


def test_progress_reaches_the_caller_under_its_own_token(short_dir: Path) -> None:
    async def progress_then_answer(message: dict[str, Any], writer: asyncio.StreamWriter) -> None:
        token = message["params"]["_meta"]["progressToken"]
        for count in (1, 2):
            writer.write(encode(notification(PROGRESS, {"progressToken": token, "progress": count, "content": []})))
        writer.write(encode(response(message["id"], {"status": "ok"})))

    async def scenario(view: View, hosts: dict[str, FakeHost], upstreams: Hosts) -> None:
        view.users[USER] = UserRecord(USER, "a", 1)
        heard: list[dict[str, Any]] = []
        sending = Sending("tools/call", {"user": USER, "name": "hello", "_meta": {"progressToken": "mine"}},
                          deadline_s=5, wait_s=5, on_progress=heard.append, client_token="mine", rewrite=_rewrite)
        # Two at once on one connection: each hears only its own progress.
        others: list[dict[str, Any]] = []
        other = Sending("tools/call", {"user": USER, "name": "hello", "_meta": {"progressToken": "mine"}},
                        deadline_s=5, wait_s=5, on_progress=others.append, client_token="theirs", rewrite=_rewrite)
        await asyncio.gather(routed(USER, sending, view, upstreams), routed(USER, other, view, upstreams))
        assert [(p["progressToken"], p["progress"]) for p in heard] == [("mine", 1), ("mine", 2)]
        assert [(p["progressToken"], p["progress"]) for p in others] == [("theirs", 1), ("theirs", 2)]

    run(short_dir, {"a": progress_then_answer}, scenario)


def test_a_caller_that_leaves_frees_its_slot_and_cancels_upstream(short_dir: Path) -> None:
    async def hold(message: dict[str, Any], writer: asyncio.StreamWriter) -> None:
        return None

    async def scenario(view: View, hosts: dict[str, FakeHost], upstreams: Hosts) -> None:
        view.users[USER] = UserRecord(USER, "a", 1)
        routing = asyncio.ensure_future(routed(USER, call(), view, upstreams))
        while not hosts["a"].calls():
            await asyncio.sleep(0.01)
        routing.cancel()
        with pytest.raises(asyncio.CancelledError):
            await routing
        assert upstreams.by_node["a"].in_flight == 0
        await asyncio.sleep(0.05)
        assert hosts["a"].seen[-1]["method"] == "notifications/cancelled"

    run(short_dir, {"a": hold}, scenario)


LIMITS = {"maxPerUser": 4, "maxTotal": 32, "minIdle": 1, "idleTtlS": 300, "defaultTimeoutMs": 1, "maxTimeoutMs": 2,
          "allowedEnv": ["A"]}


def test_the_fleets_status_reads_as_one_daemons(short_dir: Path) -> None:
    from sandboxd.cli.client_cmds import format_status
    from sandboxd.config import load_config
    from sandboxd.router import fleet

    def status_of(user: str, busy: int) -> Script:
        async def answer(message: dict[str, Any], writer: asyncio.StreamWriter) -> None:
            row = {"starting": 0, "idle": 1, "busy": busy, "stopping": 0, "waiting": 0}
            writer.write(encode(response(message["id"], {
                "version": "x", "backend": "docker", "calls": {"ok": 2}, "limits": LIMITS,
                "pool": {"totals": row, "users": {user: row}, "counters": {"started": 1}}})))
        return answer

    async def silent(message: dict[str, Any], writer: asyncio.StreamWriter) -> None:
        return None

    async def scenario(view: View, hosts: dict[str, FakeHost], upstreams: Hosts) -> None:
        config = load_config(environ={})
        status = await fleet.status(config, fleet.Asking(view, upstreams), connections=1, in_flight=0, started_at=0.0)
        assert status["pool"]["users"] == {"a@x.io": {"starting": 0, "idle": 1, "busy": 0, "stopping": 0, "waiting": 0},
                                           "b@x.io": {"starting": 0, "idle": 1, "busy": 2, "stopping": 0, "waiting": 0}}
        assert status["pool"]["totals"]["busy"] == 2 and status["calls"] == {"ok": 4}
        assert status["limits"] == LIMITS and status["unanswered"] == ["c"]  # silent past 2 s
        assert set(status["hosts"]) == {"a", "b"}
        text = format_status(status)
        assert "a@x.io: 1 idle" in text  # `sandboxd status` reads it as a daemon's
        assert "router in front of 3 hosts" in text and "host b (active): 1 idle, 2 busy" in text
        assert "host c: DID NOT ANSWER" in text  # and says which host is silent
        view.hosts.clear()
        assert "0 idle" in format_status(await fleet.status(config, fleet.Asking(view, upstreams), connections=1,
                                                            in_flight=0, started_at=0.0))

    run(short_dir, {"a": status_of("a@x.io", 0), "b": status_of("b@x.io", 2), "c": silent}, scenario)


def test_connections_past_the_routers_bound_are_answered_and_closed(short_dir: Path) -> None:
    from sandboxd.config import load_config
    from sandboxd.router.server import Router

    async def scenario(view: View, hosts: dict[str, FakeHost], upstreams: Hosts) -> None:
        config = load_config(overrides={"socket": short_dir / "router.sock"}, environ={})
        router = Router(config, view, unix_dial, max_clients=2)
        await router.start()
        try:
            served = [await asyncio.open_unix_connection(str(config.socket)) for _ in range(2)]
            for reader, writer in served:  # the two within the bound are served: a call reaches host a
                writer.write(encode(request(1, "tools/call", {"user": USER, "name": "hello"})))
                assert json.loads(await asyncio.wait_for(reader.readline(), 5))["result"]["status"] == "ok"
            reader, writer = await asyncio.open_unix_connection(str(config.socket))
            refused = json.loads(await asyncio.wait_for(reader.readline(), 5))
            assert refused["error"]["code"] == -32003 and "2 connections" in refused["error"]["message"]
            assert await asyncio.wait_for(reader.read(), 5) == b""  # then closed
            for _, served_writer in served:
                served_writer.close()
            writer.close()
        finally:
            await router.close()

    run(short_dir, {"a": ok}, scenario)


def test_pings_pipelined_by_a_client_cost_each_host_one_ping_at_a_time(short_dir: Path) -> None:
    from sandboxd.router import fleet

    async def slow_pong(message: dict[str, Any], writer: asyncio.StreamWriter) -> None:
        await asyncio.sleep(0.2)
        writer.write(encode(response(message["id"], {})))

    async def scenario(view: View, hosts: dict[str, FakeHost], upstreams: Hosts) -> None:
        asking = fleet.Asking(view, upstreams)
        answers = await asyncio.gather(*(fleet.ping(asking) for _ in range(500)))
        assert all(set(answer["hosts"]) == {"a", "b"} and answer["unanswered"] == [] for answer in answers)
        assert len(hosts["a"].seen) == len(hosts["b"].seen) == 1
        await fleet.ping(asking)  # the next ask, once the last one answered, asks again
        assert len(hosts["a"].seen) == 2

    run(short_dir, {"a": slow_pong, "b": slow_pong}, scenario)


def test_a_client_that_reads_nothing_while_progress_floods_is_disconnected_and_its_call_cancelled(
        short_dir: Path) -> None:
    from sandboxd.config import load_config
    from sandboxd.router.server import Router

    async def flood(message: dict[str, Any], writer: asyncio.StreamWriter) -> None:
        if message.get("method") == "tools/call":
            token = message["params"]["_meta"]["progressToken"]
            for count in range(1, 4001):  # ~4 MiB of progress
                writer.write(encode(notification(PROGRESS, {"progressToken": token, "progress": count,
                                                            "content": [{"type": "text", "text": "x" * 1000}]})))
                await writer.drain()
        elif message.get("method") == "notifications/cancelled":
            writer.write(encode(response(message["params"]["requestId"], {"status": "cancelled"})))

    async def scenario(view: View, hosts: dict[str, FakeHost], upstreams: Hosts) -> None:
        config = load_config(overrides={"socket": short_dir / "router.sock"}, environ={})
        router = Router(config, view, unix_dial)
        router.max_unread = 1 << 20
        await router.start()
        try:
            reader, writer = await asyncio.open_unix_connection(str(config.socket))
            writer.write(encode(request(1, "tools/call", {"user": USER, "name": "flood"})))  # and never reads
            def cancelled() -> bool:
                return any(m.get("method") == "notifications/cancelled" for m in hosts["a"].seen)

            for _ in range(200):  # 10 s at most
                if cancelled() and not router.forwarding:
                    break
                await asyncio.sleep(0.05)
            assert any(m.get("method") == "notifications/cancelled" for m in hosts["a"].seen)
            assert not router.connections and not router.forwarding  # disconnected; the call answered and gone
            writer.close()
        finally:
            await router.close()

    run(short_dir, {"a": flood}, scenario)


def test_a_verbatim_call_gets_the_hosts_result_bytes_and_refusals_are_still_read(short_dir: Path) -> None:
    result = {"status": "ok", "content": [{"type": "text", "text": "héllo \u2028 " + "x" * 70_000}], "n": 1.5}

    async def big(message: dict[str, Any], writer: asyncio.StreamWriter) -> None:
        if "id" in message:
            writer.write(encode(response(message["id"], result)))

    async def scenario(view: View, hosts: dict[str, FakeHost], upstreams: Hosts) -> None:
        view.users[USER] = UserRecord(USER, "a", 1)  # stale: b holds the user, and answers unparsed
        hosts["a"].script = refusing("elsewhere", node="b", address=str(hosts["b"].path))
        answer = await routed(USER, call(verbatim=True), view, upstreams)
        assert isinstance(answer, Verbatim) and json.loads(answer.result) == result
        assert (len(hosts["a"].calls()), len(hosts["b"].calls())) == (1, 1)
        # The client's answer carries the bytes under its own id (server/rpc.py's encoding, unchanged).
        line = encode(response("client-7", _result(answer)))
        assert json.loads(line) == {"jsonrpc": "2.0", "id": "client-7", "result": result}

    run(short_dir, {"a": ok, "b": big}, scenario)


@pytest.mark.parametrize("line, read", [
    (b'{"jsonrpc":"2.0","id":12,"result":{"a":[1,"}"]}}', (12, b'{"a":[1,"}"]}')),
    (b'{"jsonrpc":"2.0","id":12,"error":{"code":-32005,"message":"m"}}', None),  # refusals are parsed
    (b'{"jsonrpc":"2.0","method":"notifications/progress","params":{"progressToken":3}}', None),
    (b'{"jsonrpc":"2.0","id":"12","result":{}}', None),  # not an id the router gave
    (b'{"jsonrpc":"2.0","id":-1,"result":{}}', None),
    (b'{"jsonrpc":"2.0","id":12,"result":{}} ', None),
    (b'{"jsonrpc": "2.0", "id": 12, "result": {}}', None),  # another writer's spacing: parsed whole
])
def test_only_a_success_answer_as_the_host_writes_it_is_read_verbatim(line: bytes, read: Any) -> None:
    assert verbatim_answer(line) == read
