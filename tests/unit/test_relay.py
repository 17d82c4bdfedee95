"""The kernel relay (egress/relay.py) on real sockets: bytes both ways, ends, budgets, backpressure, fds."""

from __future__ import annotations

import asyncio
import os
import socket
from typing import Any

import pytest

from sandboxd.egress import relay
from sandboxd.egress.relay import MIN_COST, Relay


class Unlimited:
    def __init__(self) -> None:
        self.spent = 0
        self.spends = 0

    def available(self) -> float:
        return float("inf")

    def refill_time(self, size: float) -> float:
        return 0.0

    def spend(self, size: int) -> None:
        self.spent += size
        self.spends += 1


def pairs() -> tuple[socket.socket, socket.socket, socket.socket, socket.socket]:
    """(the sandbox's end, the relay's client side, the relay's upstream side, the destination's end)."""
    sandbox, client = socket.socketpair()
    upstream, destination = socket.socketpair()
    for sock in (sandbox, client, upstream, destination):
        sock.setblocking(False)
    return sandbox, client, upstream, destination


async def read_all(sock: socket.socket) -> bytes:
    loop, out = asyncio.get_running_loop(), bytearray()
    while True:
        data = await loop.sock_recv(sock, 1 << 16)
        if not data:
            return bytes(out)
        out += data


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


@pytest.mark.parametrize("splice", [True, False], ids=["splice", "copy"])
def test_bytes_go_both_ways_and_the_answers_end_ends_the_tunnel(splice: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    if not splice:
        monkeypatch.setattr(relay._pipes, "take", lambda: None)  # no pipe to be had: a buffer instead

    async def scenario() -> None:
        sandbox, client, upstream, destination = pairs()
        loop, budget = asyncio.get_running_loop(), Unlimited()
        request, answer = os.urandom(3 << 20), os.urandom(5 << 20)
        tunnel = asyncio.ensure_future(Relay(client, upstream, budget, idle_timeout_s=30).run())

        async def destination_side() -> bytes:
            got = await read_all(destination)  # until the sandbox's half-close reaches it
            await loop.sock_sendall(destination, answer)
            destination.shutdown(socket.SHUT_WR)
            return got

        served = asyncio.ensure_future(destination_side())
        await loop.sock_sendall(sandbox, request)
        sandbox.shutdown(socket.SHUT_WR)
        assert await asyncio.wait_for(read_all(sandbox), 20) == answer
        assert await asyncio.wait_for(served, 20) == request
        await asyncio.wait_for(tunnel, 5)
        assert budget.spent >= len(request) + len(answer)
        for sock in (sandbox, client, upstream, destination):
            sock.close()

    before = open_fds()
    asyncio.run(scenario())
    assert open_fds() <= before + relay.SPARE_PIPES * 2  # only the pooled empty pipes stay


def test_tiny_pieces_cost_a_wakeups_worth_each() -> None:
    async def scenario() -> None:
        sandbox, client, upstream, destination = pairs()
        loop, budget = asyncio.get_running_loop(), Unlimited()
        tunnel = asyncio.ensure_future(Relay(client, upstream, budget, idle_timeout_s=30).run())
        for _ in range(20):
            await loop.sock_sendall(sandbox, b"x")
            assert await asyncio.wait_for(loop.sock_recv(destination, 10), 5) == b"x"
        assert budget.spends == 20 and budget.spent == 20 * MIN_COST
        destination.close()  # the destination goes away: the tunnel ends
        sandbox.close()
        await asyncio.wait_for(tunnel, 5)
        client.close()
        upstream.close()

    asyncio.run(scenario())


def test_a_reader_that_stops_stops_the_relay_reading() -> None:
    async def scenario() -> None:
        sandbox, client, upstream, destination = pairs()
        loop = asyncio.get_running_loop()
        tunnel = asyncio.ensure_future(Relay(client, upstream, Unlimited(), idle_timeout_s=30).run())
        chunk, sent = b"y" * (1 << 16), 0
        while True:  # the destination sends; the sandbox reads nothing
            try:
                sent += destination.send(chunk)
            except BlockingIOError:
                await asyncio.sleep(0.05)  # the relay's turn, then try once more
                try:
                    sent += destination.send(chunk)
                    continue
                except BlockingIOError:
                    break
        # What is held in between is the socket buffers and at most one pipe, never the stream.
        assert sent < 16 << 20, sent
        received = 0
        destination.shutdown(socket.SHUT_WR)
        while received < sent:
            data = await asyncio.wait_for(loop.sock_recv(sandbox, 1 << 16), 5)
            assert data
            received += len(data)
        assert received == sent
        await asyncio.wait_for(tunnel, 5)
        for sock in (sandbox, client, upstream, destination):
            sock.close()

    asyncio.run(scenario())


class Metered:
    """``rate`` bytes a second, ``rate`` at once, on a clock the test moves."""

    def __init__(self, rate: float) -> None:
        self.rate, self.tokens = rate, rate
        self.now = 0.0
        self._at = 0.0

    def _refill(self) -> None:
        self.tokens = min(self.rate, self.tokens + (self.now - self._at) * self.rate)
        self._at = self.now

    def available(self) -> float:
        self._refill()
        return self.tokens

    def refill_time(self, size: float) -> float:
        self._refill()
        return max(0.0, (size - self.tokens) / self.rate)

    def spend(self, size: int) -> None:
        self._refill()
        self.tokens -= size


def test_a_direction_moves_no_more_than_its_budget_allows() -> None:
    async def scenario() -> None:
        sandbox, client, upstream, destination = pairs()
        loop, budget = asyncio.get_running_loop(), Metered(rate=100_000)
        tunnel_relay = Relay(client, upstream, budget, idle_timeout_s=30)
        tunnel = asyncio.ensure_future(tunnel_relay.run())
        sending = asyncio.ensure_future(loop.sock_sendall(destination, b"z" * 1_000_000))  # more than the buffers hold
        await asyncio.sleep(0.3)
        got = b""
        try:
            while True:
                got += sandbox.recv(1 << 20)
        except BlockingIOError:
            pass
        # One second's worth at once; the clock stands still, so nothing more.
        assert 0 < len(got) <= 100_000, len(got)
        tunnel_relay.budget = Unlimited()  # the limit lifted: the rest goes at the pause's end, then the end
        while len(got) < 1_000_000:
            data = await asyncio.wait_for(loop.sock_recv(sandbox, 1 << 20), 5)
            assert data
            got += data
        await sending
        destination.shutdown(socket.SHUT_WR)
        assert await asyncio.wait_for(loop.sock_recv(sandbox, 1), 5) == b""
        await asyncio.wait_for(tunnel, 5)
        sandbox.close()
        destination.close()
        client.close()
        upstream.close()

    asyncio.run(scenario())


def test_a_tunnel_idle_for_its_timeout_ends() -> None:
    async def scenario() -> None:
        sandbox, client, upstream, destination = pairs()
        await asyncio.wait_for(Relay(client, upstream, Unlimited(), idle_timeout_s=0.2).run(), 5)
        for sock in (sandbox, client, upstream, destination):
            sock.close()

    asyncio.run(scenario())


def test_pipes_with_too_little_room_are_not_used(monkeypatch: pytest.MonkeyPatch) -> None:
    real_fcntl = relay.fcntl.fcntl

    def tiny(fd: int, cmd: int, arg: Any = 0) -> Any:
        if cmd == relay.fcntl.F_SETPIPE_SZ:
            raise PermissionError(1, "the user's pipe pages are used up")
        if cmd == relay.fcntl.F_GETPIPE_SZ:
            return 4096  # what the kernel gives past pipe-user-pages-soft: one page
        return real_fcntl(fd, cmd, arg)

    monkeypatch.setattr(relay.fcntl, "fcntl", tiny)
    pool = relay._Pipes()
    before = open_fds()
    assert pool.take() is None and open_fds() == before


def open_pipes() -> int:
    return sum(os.readlink(f"/proc/self/fd/{fd}").startswith("pipe:") for fd in os.listdir("/proc/self/fd")
               if os.path.exists(f"/proc/self/fd/{fd}"))


def test_the_pool_opens_no_more_pipes_than_the_budget_counts(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(relay, "RELAY_PIPES", 3)
    pool, before = relay._Pipes(), open_pipes()
    held = [pool.take() for _ in range(3)]
    assert None not in held and pool.take() is None and open_pipes() == before + 6
    pipes = [pipe for pipe in held if pipe is not None]
    pool.discard(pipes.pop())  # a tunnel ended with bytes in its pipe: one may be opened again
    again = pool.take()
    assert again is not None and pool.take() is None
    for pipe in [*pipes, again]:
        pool.give(pipe)
    assert pool.open == 3 and open_pipes() == before + 6  # pooled for the next fill, still counted


def test_tunnels_stalled_both_ways_hold_no_more_pipes_than_the_budget_counts(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each direction of each tunnel holds bytes its reader does not take; past ``RELAY_PIPES`` a direction
    waits in a buffer of at most COPY_BYTES, and every byte still arrives once the readers read."""
    monkeypatch.setattr(relay, "RELAY_PIPES", 4)
    monkeypatch.setattr(relay, "_pipes", relay._Pipes())

    async def stall(sender: socket.socket) -> int:
        sent, chunk = 0, b"s" * (1 << 16)
        for _ in range(3):  # until neither the sockets nor the relay take more
            try:
                while True:
                    sent += sender.send(chunk)
            except BlockingIOError:
                await asyncio.sleep(0.1)
        return sent

    async def drain(reader: socket.socket, size: int) -> None:
        loop, got = asyncio.get_running_loop(), 0
        while got < size:
            data = await asyncio.wait_for(loop.sock_recv(reader, 1 << 20), 5)
            assert data and set(data) <= {ord("s")}
            got += len(data)

    async def scenario() -> None:
        tunnels = [pairs() for _ in range(6)]
        relays = [Relay(client, upstream, Unlimited(), idle_timeout_s=30) for _, client, upstream, _ in tunnels]
        running = [asyncio.ensure_future(r.run()) for r in relays]
        before = open_pipes()
        sent = await asyncio.gather(*(stall(end) for sandbox, _, _, destination in tunnels
                                      for end in (sandbox, destination)))
        assert open_pipes() - before == 2 * relay.RELAY_PIPES, "every direction stalled; only the counted pipes are held"
        buffered = [len(d._buffer) for r in relays for d in (r._up, r._down)]
        assert max(buffered) <= relay.COPY_BYTES and sum(1 for b in buffered if b) >= 12 - relay.RELAY_PIPES
        await asyncio.gather(*(drain(end, size) for (sandbox, _, _, destination), pair in
                               zip(tunnels, zip(sent[::2], sent[1::2]))
                               for end, size in ((destination, pair[0]), (sandbox, pair[1]))))
        for sandbox, client, upstream, destination in tunnels:
            destination.close()
            sandbox.close()
        await asyncio.wait_for(asyncio.gather(*running), 5)
        for _, client, upstream, _ in tunnels:
            client.close()
            upstream.close()

    asyncio.run(scenario())
