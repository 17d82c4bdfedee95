"""A tunnel's bytes, moved in the kernel: splice(2) through a pipe, driven by the loop's readiness callbacks.

The proxy's control work (the head, the decision, the connect) runs as coroutines on the
daemon's one loop, beside every call. Once a tunnel is up, its bytes never enter Python:
when a socket is readable, splice moves what it holds into a pipe and on into the other
socket, a few times over, within the sandbox's budget. What costs the loop is wakeups,
not bytes, so each one moves as much as it may: a pipe of ``PIPE_BYTES`` (splice fills a
pipe slot per packet fragment, and a default pipe's 16 slots held ~22 KB of loopback
TCP), up to ``WAKEUP_BYTES`` per wakeup, and a sandbox over its rate pauses for at least
``MIN_PAUSE_S``. docs/performance.md ("Noisy neighbours") has the figures.

Pipes are pooled: a direction holds one only while bytes wait in it for a slow reader;
one that moves everything at once gives it back in the same callback. At most
``RELAY_PIPES`` exist at once, every tunnel's together: the descriptor budget counts them
(service/fds.py), and they pin at most 256 KiB of kernel memory each. A direction that
gets no pipe (all held by stalled tunnels, or the kernel's pipe-user-pages limits) copies
through a buffer of at most ``COPY_BYTES`` instead, as it does where splice is not to be had.

Budgets: every byte moved, both ways, is spent from the sandbox's ``Budget``; a wakeup
costs at least ``MIN_COST`` of it, so a tool sending in tiny pieces cannot turn its rate
into a flood of wakeups. Backpressure is the kernel's: a direction reads no more while it
holds bytes the other socket does not take yet. An upstream socket lets at most
``UNSENT_BYTES`` wait unsent (egress/session.py sets it where it connects).
"""

from __future__ import annotations

import asyncio
import errno
import fcntl
import os
import socket
import time
from typing import Protocol

from sandboxd.service.fds import RELAY_PIPES

PIPE_BYTES = 256 << 10
MIN_PIPE_BYTES = 64 << 10  # less than this (the user's pipe limits reached) and a buffer does better
COPY_BYTES = 64 << 10  # read at once without a pipe: what a stalled direction holds in memory, at most
# What may wait unsent in an upstream socket (TCP_NOTSENT_LOWAT): for an upstream that never reads, the
# kernel would otherwise queue up to tcp_wmem's most (4 MiB) per tunnel; bytes in flight are not limited.
UNSENT_BYTES = 128 << 10
WAKEUP_BYTES = 1 << 20  # then other connections' turn: the socket is still readable, the loop comes back
MIN_COST = 16 << 10  # what a wakeup costs of the budget, however little it moved
MIN_PAUSE_S = 0.01
SPARE_PIPES = 8  # empty pipes kept for the next fill
_FLAGS = os.SPLICE_F_MOVE | os.SPLICE_F_NONBLOCK


class Budget(Protocol):
    """Bytes a sandbox may move (egress/proxy.py's per-sandbox share)."""

    def available(self) -> float:
        """Bytes that may be moved now (none when ≤ 0)."""

    def refill_time(self, size: float) -> float:
        """Seconds until ``size`` bytes may be moved."""

    def spend(self, size: int) -> None: ...


class _Pipes:
    """Empty pipes for the next fill, sized once (the daemon's pipe pages are a per-user kernel budget);
    at most ``RELAY_PIPES`` open at once, pooled or held, the number the descriptor budget counts."""

    def __init__(self) -> None:
        self._free: list[tuple[int, int]] = []
        self.open = 0  # pipes that exist: pooled, or held by a direction

    def take(self) -> tuple[int, int] | None:
        """An empty pipe, or None: every pipe the budget counts is held (or the kernel gave none): copy instead."""
        if self._free:
            return self._free.pop()
        if self.open >= RELAY_PIPES:
            return None
        try:
            r, w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        except OSError:
            return None  # out of fds: copy instead
        try:
            fcntl.fcntl(w, fcntl.F_SETPIPE_SZ, PIPE_BYTES)
        except OSError:
            pass  # past pipe-max-size or the user's pages: what the kernel gave
        if fcntl.fcntl(w, fcntl.F_GETPIPE_SZ) < MIN_PIPE_BYTES:
            os.close(r)
            os.close(w)
            return None
        self.open += 1
        return r, w

    def give(self, pipe: tuple[int, int]) -> None:
        """Back, empty; kept if there is room, else closed."""
        if len(self._free) < SPARE_PIPES:
            self._free.append(pipe)
        else:
            self.discard(pipe)

    def discard(self, pipe: tuple[int, int]) -> None:
        """Closed: bytes left in it (a tunnel ended mid-way), or no room to keep it."""
        for fd in pipe:
            os.close(fd)
        self.open -= 1


_pipes = _Pipes()


class _Direction:
    """One way of a tunnel: ``src`` → pipe → ``dst`` (or a buffer where no pipe is to be had).

    One method, ``_pump``, moves bytes; the readiness callbacks and the end of a pause call it.
    """

    def __init__(self, relay: Relay, src: socket.socket, dst: socket.socket) -> None:
        self._relay, self._loop = relay, relay.loop
        self._src, self._dst, self._dst_sock = src.fileno(), dst.fileno(), dst
        self._pipe: tuple[int, int] | None = None  # held while bytes wait in it
        self._splice = True  # False once splice proved impossible here: copy through _buffer
        self._buffer = bytearray()  # copying: what was read and not yet sent
        self._held = 0  # bytes read from src, not yet written to dst
        self._eof = False
        self._reading = self._writing = False
        self._resume: asyncio.TimerHandle | None = None
        self.done = False

    def start(self) -> None:
        self._set_reading(True)

    def close(self) -> None:
        self._set_reading(False)
        self._set_writing(False)
        if self._resume is not None:
            self._resume.cancel()
        if self._pipe is not None:  # bytes left in it: it cannot serve another direction
            _pipes.discard(self._pipe)
            self._pipe = None

    def _set_reading(self, on: bool) -> None:
        if on and not self._reading and not self.done:
            self._loop.add_reader(self._src, self._pump)
        elif not on and self._reading:
            self._loop.remove_reader(self._src)
        self._reading = on and not self.done

    def _set_writing(self, on: bool) -> None:
        if on and not self._writing:
            self._loop.add_writer(self._dst, self._pump)
        elif not on and self._writing:
            self._loop.remove_writer(self._dst)
        self._writing = on

    def _resumed(self) -> None:
        self._resume = None
        self._pump()

    def _pump(self) -> None:
        """Move bytes until src has no more, dst takes no more, the budget says wait, or this wakeup's share is used."""
        budget, moved = self._relay.budget, 0
        try:
            while True:
                if self._held:  # what was read goes on first
                    try:
                        self._held -= self._drain()
                    except BlockingIOError:  # dst is full: wait until it takes more, read nothing meanwhile
                        self._set_reading(False)
                        self._set_writing(True)
                        return
                    continue
                self._set_writing(False)
                self._release_pipe()
                if self._eof:
                    return self._finish()
                if self._resume is not None:  # paused: only the pause's end reads again
                    return
                if moved >= WAKEUP_BYTES:  # other connections' turn; still readable, so the loop comes back
                    self._set_reading(True)
                    return
                allowed = budget.available()
                if allowed < MIN_COST:  # the sandbox is at its rate: read again once a wakeup's worth has refilled
                    self._set_reading(False)
                    self._resume = self._loop.call_later(max(budget.refill_time(MIN_COST), MIN_PAUSE_S),
                                                         self._resumed)
                    return
                try:
                    read = self._fill(int(min(allowed, PIPE_BYTES)))
                except BlockingIOError:
                    self._set_reading(True)
                    return
                if read == 0:
                    self._eof = True
                    self._set_reading(False)
                    continue
                budget.spend(max(read, MIN_COST))
                self._relay.touch()
                moved += read
        except OSError:  # the peer went away, or a socket broke
            self._relay.ended(self)

    def _fill(self, size: int) -> int:
        if self._splice and self._pipe is None:
            self._pipe = _pipes.take()
        if self._splice and self._pipe is not None:
            try:
                read = os.splice(self._src, self._pipe[1], size, flags=_FLAGS)
            except OSError as exc:
                if exc.errno != errno.EINVAL:
                    raise
                self._splice = False  # this kernel or socket type cannot splice: copy from now on
                self._release_pipe()
                return self._fill(size)
        else:
            data = os.read(self._src, min(size, COPY_BYTES))
            self._buffer += data
            read = len(data)
        self._held += read
        return read

    def _drain(self) -> int:
        if self._pipe is not None:
            return os.splice(self._pipe[0], self._dst, self._held, flags=_FLAGS)
        sent = os.write(self._dst, self._buffer)
        del self._buffer[:sent]
        return sent

    def _release_pipe(self) -> None:
        if self._pipe is not None:
            _pipes.give(self._pipe)
            self._pipe = None

    def _finish(self) -> None:
        self.done = True
        try:
            self._dst_sock.shutdown(socket.SHUT_WR)  # pass the end on (a half-close)
        except OSError:
            pass
        self._relay.ended(self, cleanly=True)


class Relay:
    """Both ways of one tunnel, until the upstream's side is done, either side breaks, or it sits idle.

    ``client`` is the sandbox's connection, ``upstream`` the destination's; both are
    non-blocking sockets that no transport owns. The caller closes them after ``run``.
    """

    def __init__(self, client: socket.socket, upstream: socket.socket, budget: Budget, idle_timeout_s: float,
                 *, upload: bool = True) -> None:
        self.loop = asyncio.get_running_loop()
        # False: the proxy sent the request itself (an absolute-form request it parsed); only the answer moves.
        self._upload = upload
        self.budget = budget
        self._idle_timeout_s = idle_timeout_s
        self._last = time.monotonic()
        self._finished: asyncio.Future[None] = self.loop.create_future()
        self._up = _Direction(self, client, upstream)
        self._down = _Direction(self, upstream, client)

    def touch(self) -> None:
        self._last = time.monotonic()

    def ended(self, direction: _Direction, *, cleanly: bool = False) -> None:
        """A direction is over: the response's end (or a break) ends the tunnel; the request's end only half-closes."""
        if cleanly and direction is self._up and not self._down.done:
            return  # the sandbox sent all it will; the answer may still be coming
        if not self._finished.done():
            self._finished.set_result(None)

    async def run(self) -> None:
        if self._upload:
            self._up.start()
        self._down.start()
        try:
            while True:
                try:
                    await asyncio.wait_for(asyncio.shield(self._finished), min(self._idle_timeout_s, 5.0))
                    return
                except TimeoutError:
                    if time.monotonic() - self._last > self._idle_timeout_s:
                        return
        finally:
            self._up.close()
            self._down.close()
