"""Warm sandboxes per user, modelled on httpcore's connection pool.

The pool's state is which sandboxes exist (``_sandboxes``; the same by user in
``_of_user``), what each is doing (its ``State``) and who waits for one (``_waiters``).
One synchronous step, ``_plan``, changes it: it settles what the events recorded, hands
idle sandboxes to waiting callers, and returns what to start and what to destroy; the
backend calls (slow, fallible) happen after, in ``_apply``. The events only record what
happened, on the sandbox it happened to (``PooledSandbox``'s facts: its call ended, its
start finished or failed, the backend removed it) or in ``_waiters`` (a caller came or
left), and ask for a plan; ``close`` ends it all at once.

A plan looks at every sandbox and every active user when anyone waits, when room frees
up, and every second (``maintain``). When nobody waits and only one user's sandboxes
changed (a call of theirs arrives or ends, they list their tools, a start of theirs
ends), it looks at that user's sandboxes alone: the same steps and rules, a few µs at any
pool size, where a walk of everything costs ~1 ms at 500 users on every call's path. A
caller that is cancelled while it waits never leaks a slot: ``acquire`` gives back
whatever it was handed.

Users share the pool max-min fairly, with the last ``pool.reserve`` slots kept for users'
first calls: sharing.py decides whose turn it is and what serves it, and ``_plan`` carries
each decision out. The records (``PooledSandbox``, ``Waiter``, ``Plan``) are pooled.py's.

A sandbox being destroyed stays in ``_sandboxes`` (STOPPING) until the backend has
removed it, so the limits bound the containers that exist, not just the usable
ones: a tool that times out again and again cannot pile up containers still
burning CPU while the engine works through their removals.
"""

from __future__ import annotations

import asyncio
import collections
import time
from typing import Any, Callable

from sandboxd.config import PoolConfig
from sandboxd.errors import BackendUnavailable, Overloaded, SandboxdError, ShuttingDown
from sandboxd.logging import get_logger, source
from sandboxd.sandbox.backend import Backend, SandboxSpec
from sandboxd.sandbox.pooled import BUSY, HELD, IDLE, STARTING, STOPPING, Plan, PooledSandbox, State, Waiter
from sandboxd.sandbox.sharing import Actions, Counts, holdings, serve_fairly

__all__ = ["Pool", "PooledSandbox", "State"]

log = get_logger("sandboxd.pool")

# After a failed start, warm-keeping (not callers) waits this long before trying again.
START_BACKOFF_S = 1.0
# Why a caller's wait for a sandbox ran out (sandboxd_pool_refusals_total{reason}).
REFUSAL_REASONS = ("user_limit", "reserve", "pool_full")


class Pool:
    def __init__(
        self,
        backend: Backend,
        config: PoolConfig,
        spec_for: Callable[[str], SandboxSpec],
        *,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._backend = backend
        self.config = config
        self._spec_for = spec_for
        self._clock = clock
        # The pool's whole mutable state:
        self._sandboxes: list[PooledSandbox] = []
        self._waiters: list[Waiter] = []  # in arrival order: a user's own callers are served first come, first served
        # The same sandboxes by user, in pool order: a plan of one user looks at theirs only.
        self._of_user: dict[str, list[PooledSandbox]] = {}
        # Bookkeeping that _plan reads:
        self._last_call: dict[str, float] = {}  # user → last acquire/release; drives min_idle and the idle TTL
        self._backoff_until: dict[str, float] = {}
        self._closing = False
        self._tasks: set[asyncio.Task[Any]] = set()
        self._starts: set[asyncio.Task[Any]] = set()
        self._generation = 0
        # killed: by sandboxd mid-call (timeout, cancel past the grace); crashed: died by itself.
        self.stats = {"started": 0, "destroyed": 0, "crashed": 0, "killed": 0, "start_failures": 0}
        # Callers whose wait ran out, by why (REFUSAL_REASONS).
        self.refusals = dict.fromkeys(REFUSAL_REASONS, 0)

    # -- the public surface -------------------------------------------------

    async def acquire(self, user: str, timeout: float | None = None) -> PooledSandbox:
        """An idle sandbox of ``user``, started if need be; raises Overloaded past the deadline."""
        if self._closing:
            raise ShuttingDown()
        self._last_call[user] = self._clock()
        if not self._waiters:
            # The common call: nobody waits, so a plan of this user's sandboxes alone hands it
            # their idle one if they have one (and the reserve allows).
            plan = self._plan(user, caller=True)
            self._apply(plan)
            if plan.handed is not None:
                return plan.handed
        waiter = Waiter(user, asyncio.get_running_loop().create_future())
        self._waiters.append(waiter)
        self._apply(self._plan())
        timeout = self.config.acquire_timeout_ms / 1000 if timeout is None else timeout
        try:
            if waiter.future.done():  # served by that plan already
                return waiter.future.result()
            async with asyncio.timeout(timeout):
                return await waiter.future
        except BaseException as exc:
            if waiter in self._waiters:
                self._waiters.remove(waiter)
            # Handed a sandbox in the same tick we were cancelled or timed out: give it back.
            if waiter.future.done() and not waiter.future.cancelled() and waiter.future.exception() is None:
                self.release(waiter.future.result(), reusable=True, counted=False)
            if isinstance(exc, TimeoutError):
                raise self._refusal(user, timeout) from None
            raise

    def warm(self, user: str) -> None:
        """``user`` is about to call (a session just listed their tools): start their min_idle now.

        The user counts as active from here, as after a call, so the idle TTL applies; nothing
        is evicted for it and nobody waits for it.
        """
        if self._closing or self.config.min_idle == 0:
            return
        if user not in self._last_call and len(self._sandboxes) >= self._ceiling():
            # A full pool warms nobody new, and keeps no trace of them: listing costs no
            # sandbox, so a client could name endless made-up users, each one more entry
            # that every _plan walks.
            return
        self._last_call[user] = self._clock()
        self._replan(user)

    def release(self, pooled: PooledSandbox, *, reusable: bool, counted: bool = True) -> None:
        """Give a sandbox back after a call. Not reusable (crashed, timed out, would not cancel) → destroyed."""
        now = self._clock()
        if counted:
            pooled.calls += 1
        self._last_call[pooled.user] = now
        if pooled.state is BUSY and not pooled.call_ended and pooled in self._of_user.get(pooled.user, ()):
            alive = self._alive(pooled)
            if not reusable:
                self.stats["killed" if alive else "crashed"] += 1
            # Idle again at the plan, which destroys it at once if it is spent.
            pooled.call_ended = True
            pooled.spent = (not reusable or not alive or pooled.generation != self._generation
                            or pooled.calls >= self.config.max_calls_per_sandbox)
            self._replan(pooled.user)

    def retire_all(self) -> None:
        """New sandbox settings: replace idle sandboxes now, busy ones when their call ends."""
        self._generation += 1
        self._apply(self._plan())

    def maintain(self) -> None:
        """Expire idle sandboxes and keep users warm; called periodically by the server."""
        self._apply(self._plan())

    async def close(self, grace: float, destroy_timeout: float = 30.0) -> None:
        """Stop taking calls, wait up to ``grace`` s for busy sandboxes, then destroy everything.

        The destroys get ``destroy_timeout`` s: a hung engine must not hang shutdown; what
        is left then is removed as an orphan by the next start.
        """
        self._closing = True
        for waiter in self._waiters:
            if not waiter.future.done():
                waiter.future.set_exception(ShuttingDown())
        self._waiters.clear()
        deadline = self._clock() + grace
        # No plan runs from here on: a call's end stays a recorded fact.
        while any(p.state is BUSY and not p.call_ended for p in self._sandboxes) and self._clock() < deadline:
            await asyncio.sleep(0.05)
        doomed = [p for p in self._sandboxes if p.state is not STOPPING]  # those are on their way already
        self._sandboxes.clear()
        self._of_user.clear()
        # Starts are cancelled (the backend removes a half-made sandbox); destroys run to the end.
        for task in list(self._starts):
            task.cancel()
        for pooled in doomed:
            if pooled.sandbox is not None:
                self._spawn(self._destroy(pooled))
        if self._tasks:
            _done, pending = await asyncio.wait(set(self._tasks), timeout=destroy_timeout)
            if pending:
                log.warning("shutdown_destroy_timeout", pending=len(pending), timeout_s=destroy_timeout)
                for task in pending:
                    task.cancel()

    def __repr__(self) -> str:
        counts = {state: 0 for state in State}
        for pooled in self._sandboxes:
            counts[pooled.state] += 1
        return (
            f"<Pool [starting: {counts[STARTING]}, idle: {counts[IDLE]}, "
            f"busy: {counts[BUSY]}, stopping: {counts[STOPPING]}, waiting: {len(self._waiters)}]>"
        )

    def status(self) -> dict[str, Any]:
        """Counts by state, in all and per user (``holding``: busy or starting), the sharing rules, the counters."""
        return {**holdings(self._sandboxes, self._waiters, self.config), "counters": dict(self.stats),
                "refusals": dict(self.refusals)}

    # -- the decisions --------------------------------------------------------

    def _alive(self, pooled: PooledSandbox) -> bool:
        return pooled.sandbox is not None and pooled.sandbox.alive

    def _held(self) -> int:
        """Sandboxes held for calls in all (a walk of the pool: only where the pool is near its ceiling)."""
        return sum(1 for pooled in self._sandboxes if pooled.state in HELD)

    def _ceiling(self) -> int:
        """How many sandboxes may be held in all before only users' first calls are served."""
        return self.config.max_total - self.config.reserved

    def _replan(self, user: str) -> None:
        """Plan after an event on ``user``'s sandboxes: theirs alone while nobody waits, else everything."""
        self._apply(self._plan(None if self._waiters else user))

    def _plan(self, user: str | None = None, *, caller: bool = False) -> Plan:
        """The one step that changes the pool's state; no awaits here. Returns what to start and destroy.

        ``user``: nobody waits and only this user's sandboxes changed, so only theirs are looked
        at. ``caller``: a call of ``user`` arrives; ``plan.handed`` is the idle sandbox it takes,
        or None: it must queue, and nothing is started for it here (the full plan it queues for
        decides).
        """
        plan = Plan()
        if self._closing:
            return plan
        now, cfg = self._clock(), self.config

        # 1. Settle what the events recorded: a call or a start that ended leaves its sandbox idle, a
        #    removed one is forgotten, a failed start too (its user's callers get the error now, not at
        #    their deadline; each retry re-checks the backend). Stop idle sandboxes that died, that a
        #    call left spent, that belong to users gone quiet, or beyond min_idle past the TTL.
        idle_of: dict[str, list[PooledSandbox]] = {}  # in pool order, as step 2 hands them out
        held_total = 0  # of the sandboxes looked at: in all, or the one user's
        ttl, last_call, generation = cfg.idle_ttl_s, self._last_call, self._generation
        for pooled in list(self._sandboxes if user is None else self._of_user.get(user, ())):
            owner, state = pooled.user, pooled.state
            if pooled.call_ended or (state is STARTING and pooled.sandbox is not None):
                state = pooled.state = IDLE  # and judged as idle below
                pooled.since, pooled.call_ended = now, False
            if state is BUSY:
                held_total += 1
            elif state is STARTING:
                if pooled.start_error is None:
                    held_total += 1
                    continue
                self._forget(pooled)
                self._backoff_until[owner] = now + START_BACKOFF_S
                for waiter in [w for w in self._waiters if w.user == owner]:
                    self._waiters.remove(waiter)
                    if not waiter.future.done():
                        waiter.future.set_exception(pooled.start_error)
            elif state is STOPPING:
                if pooled.removed:
                    self._forget(pooled)
            else:
                alive = pooled.sandbox is not None and pooled.sandbox.alive
                kept = idle_of.get(owner)
                # Spent, dead, of old settings, its user gone quiet, or idle past the TTL beyond min_idle
                # (cheapest tests first: this runs at every call's acquire and release).
                if (pooled.spent or not alive or pooled.generation != generation or now - last_call.get(owner, 0.0) > ttl
                        or now - pooled.since > ttl and (len(kept) if kept else 0) >= cfg.min_idle):
                    if not alive and not pooled.spent:  # died while idle (a spent one was counted)
                        self.stats["crashed"] += 1
                    plan.destroy.append(self._stopping(pooled, now))
                elif kept is None:
                    idle_of[owner] = [pooled]
                else:
                    kept.append(pooled)
        if user is None:
            for quiet in [u for u, t in self._last_call.items() if now - t > cfg.idle_ttl_s]:
                if quiet not in self._of_user and not any(w.user == quiet for w in self._waiters):
                    del self._last_call[quiet]

        # 2. Serve the waiting callers, fairly across users; or the one arriving caller.
        queues: dict[str, collections.deque[Waiter]] = {}
        if user is None:
            for waiter in list(self._waiters):
                if waiter.future.done():  # cancelled or failed while queued
                    self._waiters.remove(waiter)
                else:
                    queues.setdefault(waiter.user, collections.deque()).append(waiter)
            if queues:
                self._serve(queues, idle_of, held_total, plan, now)
        elif caller:
            mine = idle_of.get(user)
            # The reserve is for first calls: a user already holding one waits once the pool holds its
            # ceiling (held_total is theirs here; everyone's is counted only when the pool is that full).
            into_reserve = (held_total and len(self._sandboxes) >= self._ceiling()
                            and self._held() >= self._ceiling())
            if not mine or into_reserve:
                return plan
            plan.handed = self._hand_out(mine.pop(0), now)

        # 3. Keep min_idle warm sandboxes for users who called within the TTL (never evicting for it).
        #    Not while the user's callers wait for starts: a second start at the same time slows
        #    theirs (docker create/start share the CPU); the spare follows once they are served.
        for active in (self._last_call if user is None else (user,)):
            # idle_of holds what is left idle after step 2: a user with enough needs no count (the common case).
            if (now - last_call.get(active, 0.0) > cfg.idle_ttl_s or len(idle_of.get(active, ())) >= cfg.min_idle
                    or queues.get(active)):
                continue
            self._keep_warm(active, plan, now)
        return plan

    def _serve(self, queues: dict[str, collections.deque[Waiter]], idle_of: dict[str, list[PooledSandbox]],
               held_total: int, plan: Plan, now: float) -> None:
        """Step 2 of _plan: sharing.serve_fairly decides the turns (max-min fair, the reserve kept
        for first calls); the actions make each decision here, on the pool's state, at once."""
        counts = Counts(held={user: self._count(user, *HELD) for user in queues},
                        starting={user: self._count(user, STARTING) for user in queues},
                        owned={user: len(self._of_user.get(user, ())) for user in queues},
                        total=len(self._sandboxes), held_total=held_total,
                        stopping=sum(1 for p in self._sandboxes if p.state is STOPPING))
        serve_fairly(queues, idle_of, {waiter: i for i, waiter in enumerate(self._waiters)}, counts,
                     max_per_user=self.config.max_per_user, max_total=self.config.max_total,
                     ceiling=self._ceiling(),
                     act=Actions(hand=lambda waiter, pooled: self._give(waiter, pooled, now),
                                 start=lambda user: plan.start.append(self._new(user, now)),
                                 evict=lambda pooled: plan.destroy.append(self._stopping(pooled, now))))

    def _give(self, waiter: Waiter, pooled: PooledSandbox, now: float) -> None:
        self._waiters.remove(waiter)
        waiter.future.set_result(self._hand_out(pooled, now))

    def _keep_warm(self, user: str, plan: Plan, now: float) -> None:
        """Step 3 of _plan for one user who called or listed within the TTL: start what min_idle
        misses, in room outside the reserve. It never evicts, and waits out the backoff after a failed start."""
        if now < self._backoff_until.get(user, 0.0):
            return
        cfg, ceiling = self.config, self._ceiling()
        for _ in range(cfg.min_idle - self._count(user, IDLE, STARTING)):
            if len(self._of_user.get(user, ())) >= cfg.max_per_user or len(self._sandboxes) >= ceiling:
                break
            plan.start.append(self._new(user, now))

    def _refusal(self, user: str, timeout: float) -> Overloaded:
        """Why ``user``'s wait ran out, counted by reason, in words that say what to do."""
        cfg = self.config
        mine, running = len(self._of_user.get(user, ())), self._count(user, *HELD)
        if mine >= cfg.max_per_user:
            reason, why = "user_limit", (f"{user} already holds {mine} sandboxes, the most one user may "
                                         f"(pool.max_per_user: {cfg.max_per_user}); make fewer calls at once")
        elif running and self._held() >= self._ceiling():
            reason, why = "reserve", (f"{user} already runs {running} calls, and the last {cfg.reserved} of the "
                                      f"pool's {cfg.max_total} sandboxes are kept for users' first calls "
                                      "(pool.reserve)")
        else:
            reason, why = "pool_full", f"all {cfg.max_total} sandboxes are in use by other users (pool.max_total)"
        self.refusals[reason] += 1
        return Overloaded(f"no sandbox for {user} became free within {timeout:g} s: {why}; retry later.",
                          data={"pool": repr(self), "reason": reason})

    def _count(self, user: str, *states: State) -> int:
        """The user's sandboxes in ``states``, counted afresh (a user has max_per_user at most)."""
        return sum(1 for pooled in self._of_user.get(user, ()) if pooled.state in states)

    def _forget(self, pooled: PooledSandbox) -> None:
        self._sandboxes.remove(pooled)
        mine = self._of_user[pooled.user]
        mine.remove(pooled)
        if not mine:
            del self._of_user[pooled.user]

    @staticmethod
    def _hand_out(pooled: PooledSandbox, now: float) -> PooledSandbox:
        pooled.state, pooled.since = BUSY, now
        return pooled

    def _new(self, user: str, now: float) -> PooledSandbox:
        pooled = PooledSandbox(user, STARTING, since=now, generation=self._generation)
        self._sandboxes.append(pooled)
        self._of_user.setdefault(user, []).append(pooled)
        return pooled

    # -- side effects -------------------------------------------------------

    def _apply(self, plan: Plan) -> None:
        if not (plan.start or plan.destroy):
            return  # the common plan: a call took or gave back a sandbox
        for pooled in plan.start:
            task = self._spawn(self._start(pooled))
            self._starts.add(task)
            task.add_done_callback(self._starts.discard)
        for pooled in plan.destroy:  # idle ones only: each has its sandbox
            self._spawn(self._destroy(pooled))

    def _spawn(self, coro: Any) -> asyncio.Task[Any]:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    async def _start(self, pooled: PooledSandbox) -> None:
        try:
            async with asyncio.timeout(self.config.start_timeout_ms / 1000):
                sandbox = await self._backend.start(self._spec_for(pooled.user))
        except asyncio.CancelledError:
            raise
        except BaseException as exc:
            self._start_failed(pooled, exc)
            return
        self.stats["started"] += 1
        pooled.sandbox = sandbox
        if pooled not in self._sandboxes:  # closed while starting
            self._spawn(self._destroy(pooled))
            return
        sandbox.on_exit(lambda: self._sandbox_died(pooled))
        self._replan(pooled.user)
        log.debug("sandbox_started", user=pooled.user, sandbox=sandbox.id, pool=repr(self))

    def _start_failed(self, pooled: PooledSandbox, exc: BaseException) -> None:
        self.stats["start_failures"] += 1
        if isinstance(exc, TimeoutError):
            exc = BackendUnavailable(
                f"a sandbox did not start within {self.config.start_timeout_ms} ms; check the engine's load and the image."
            )
        elif not isinstance(exc, SandboxdError):
            exc = BackendUnavailable(f"could not start a sandbox: {exc}")
        log.warning("sandbox_start_failed", user=pooled.user, error=str(exc), budget=source("user", pooled.user))
        pooled.start_error = exc
        self._replan(pooled.user)

    def _sandbox_died(self, pooled: PooledSandbox) -> None:
        """An idle sandbox died (engine restart, killed from outside): _plan sees it dead and replaces it."""
        if pooled.state is IDLE:
            self._replan(pooled.user)
        # A busy one is handled by its call, which sees the failure and releases it as not reusable.

    @staticmethod
    def _stopping(pooled: PooledSandbox, now: float) -> PooledSandbox:
        pooled.state, pooled.since = STOPPING, now
        return pooled

    async def _destroy(self, pooled: PooledSandbox) -> None:
        assert pooled.sandbox is not None
        self.stats["destroyed"] += 1
        try:
            await self._backend.destroy(pooled.sandbox)
        finally:
            # Gone (or handed to the backend's retry list): its room is free, for anyone.
            pooled.removed = True
            if not self._closing:
                self._apply(self._plan())
