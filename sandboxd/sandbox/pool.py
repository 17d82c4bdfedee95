"""Warm sandboxes per user, modelled on httpcore's connection pool.

The state is plain collections: the sandboxes (``_sandboxes``; by account in ``_of_user``), each
with its ``State``, and the callers waiting (``_waiters``). Events only record what happened
(on the ``PooledSandbox``: its call ended, its start finished or failed, the backend removed it;
or in ``_waiters``) and ask for a plan. ``_plan`` is the one decision: a function of the state
that returns a ``Plan`` (what becomes idle, is forgotten, destroyed, started; which caller gets
which sandbox), in named steps whose cases its docstring numbers. ``_commit`` applies it; then
``_act`` does the I/O. The common call needs no plan: a caller alone takes the idle sandbox a plan
would hand them (``_idle_for_alone``), and a release nobody waits for is settled by the next plan.

A plan looks at everything when anyone else waits, when room frees up, and every second
(``maintain``); else at the one user whose sandboxes changed (a walk of everything grows with
the pool). A caller cancelled while it waits never leaks a slot (``_leave``). Users share
the pool max-min fairly, the last ``pool.reserve`` slots kept for users' first calls: sharing.py
returns whose turn it is. A sandbox being destroyed counts (STOPPING) until the backend has
removed it: a tool that times out again and again cannot pile up containers.

An owner is a user and an email access (email_access.py); the limits, min_idle and the fair share
count the user's sandboxes of every access together (warm.py, sharing.py: at the limit, one is replaced).
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from typing import Any, Callable

from sandboxd.config import PoolConfig
from sandboxd.errors import BackendUnavailable, Overloaded, SandboxdError, ShuttingDown
from sandboxd.logging import get_logger, source
from sandboxd.sandbox.backend import Backend, SandboxSpec
from sandboxd.sandbox.email_access import owner_user
from sandboxd.sandbox.pooled import BUSY, IDLE, STARTING, STOPPING, Plan, PooledSandbox, State, Waiter, gone
from sandboxd.sandbox.sharing import (REFUSAL_REASONS, Counts, Hand, Limits, Replace, Start, holdings, refusal,
                                     serve_fairly)
from sandboxd.sandbox.warm import idle_by_account, used_last

__all__ = ["Pool", "PooledSandbox", "State"]

log = get_logger("sandboxd.pool")

# After a failed start, warm-keeping (not callers) waits this long before trying again.
START_BACKOFF_S = 1.0


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
        # The same sandboxes by account (every access), in pool order: a plan of one user looks at theirs only.
        self._of_user: dict[str, list[PooledSandbox]] = {}
        # Bookkeeping that _plan reads:
        self._last_call: dict[str, float] = {}  # owner → last acquire/release; drives min_idle and the idle TTL
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
        now = self._last_call[user] = self._clock()
        pooled = self._idle_for_alone(user, now)
        if pooled is not None:  # the common call: what a plan of them would hand them, without one
            pooled.state, pooled.since, pooled.call_ended = BUSY, now, False
            return pooled
        waiter = Waiter(user, asyncio.get_running_loop().create_future())
        self._waiters.append(waiter)
        # Alone in the queue, their own sandboxes decide; what that cannot do for them, a plan of everything does.
        alone = len(self._waiters) == 1
        plan = self._apply(self._plan(user if alone else None))
        if alone and not waiter.future.done() and not plan.start:
            self._apply(self._plan())
        timeout = self.config.acquire_timeout_ms / 1000 if timeout is None else timeout
        try:
            if waiter.future.done():  # served (or failed) by those plans already
                return waiter.future.result()
            async with asyncio.timeout(timeout):
                return await waiter.future
        except BaseException as exc:
            self._leave(waiter)
            if isinstance(exc, TimeoutError):
                raise self._refusal(user, timeout) from None
            raise

    def _leave(self, waiter: Waiter) -> None:
        """A caller stops waiting (timed out, cancelled): it leaks no slot."""
        if waiter in self._waiters:
            self._waiters.remove(waiter)
        # Handed a sandbox in the same tick we were cancelled or timed out: give it back.
        if waiter.future.done() and not waiter.future.cancelled() and waiter.future.exception() is None:
            self.release(waiter.future.result(), reusable=True, counted=False)

    def warm(self, user: str) -> None:
        """``user`` is about to call (a session just listed their tools): start their min_idle now.
        They count as active from here (the idle TTL applies); nothing is evicted for it."""
        if self._closing or self.config.min_idle == 0:
            return
        if user not in self._last_call and len(self._sandboxes) >= self._ceiling():
            return  # a full pool keeps no trace of new users: else endless made-up ones, each walked by every plan
        self._last_call[user] = self._clock()
        self._replan(user)

    def release(self, pooled: PooledSandbox, reusable: bool, *, counted: bool = True) -> None:
        """Give a sandbox back after a call. Not reusable (crashed, timed out, would not cancel) → destroyed."""
        now = self._clock()
        if counted:
            pooled.calls += 1
        self._last_call[pooled.user] = now
        if pooled.state is BUSY and not pooled.call_ended and pooled in self._of_user.get(pooled.account, ()):
            alive = pooled.alive
            if not reusable:
                self.stats["killed" if alive else "crashed"] += 1
            # Idle again at the plan, which destroys it at once if it is spent.
            pooled.call_ended = True
            pooled.spent = (not reusable or not alive or pooled.generation != self._generation
                            or pooled.calls >= self.config.max_calls_per_sandbox)
            if pooled.spent or self._waiters:
                self._replan(pooled.user)
            # Else nobody waits for it: the next plan settles it idle (its user's next call, or maintain's).

    def retire_all(self) -> None:
        """New sandbox settings: replace idle sandboxes now, busy ones when their call ends."""
        self._generation += 1
        self._apply(self._plan())

    def retire(self, user: str) -> list[str]:
        """``user`` went over their disk quota: their sandboxes that ran a tool, of every email access, are
        replaced as if their settings were old (idle ones now, busy ones at their call's end); returns their ids."""
        used = [pooled for pooled in self._of_user.get(user, ()) if pooled.calls or pooled.current is BUSY]
        for pooled in used:
            pooled.generation = -1
        self._apply(self._plan(None if self._waiters else user))
        return [pooled.id for pooled in used]

    def maintain(self) -> None:
        """Expire idle sandboxes and keep users warm; called periodically by the server."""
        self._apply(self._plan())

    async def close(self, grace: float, destroy_timeout: float = 30.0) -> None:
        """Stop taking calls, wait up to ``grace`` s for busy sandboxes, then destroy everything, for up to
        ``destroy_timeout`` s: a hung engine must not hang shutdown (the next start removes what is left)."""
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
        counts = Counter(pooled.current for pooled in self._sandboxes)
        return (f"<Pool [starting: {counts[STARTING]}, idle: {counts[IDLE]}, "
                f"busy: {counts[BUSY]}, stopping: {counts[STOPPING]}, waiting: {len(self._waiters)}]>")

    def status(self) -> dict[str, Any]:
        """Counts by state, in all and per user (``holding``: busy or starting), the sharing rules, the counters."""
        return {**holdings(self._sandboxes, self._waiters, self.config), "counters": dict(self.stats),
                "refusals": dict(self.refusals)}

    # -- the decisions --------------------------------------------------------

    def _ceiling(self) -> int:
        """How many sandboxes may be held in all before only users' first calls are served."""
        return self.config.max_total - self.config.reserved

    def _replan(self, user: str) -> None:
        """Plan after an event on ``user``'s sandboxes: theirs alone while nobody waits, else everything."""
        self._apply(self._plan(None if self._waiters else user))

    def _plan(self, user: str | None = None) -> Plan:
        """What to do now, as a function of the pool's state alone: nothing changes here (``_commit``
        applies the plan), nothing awaits. ``user`` (an owner): only their account's sandboxes changed and
        nobody else waits, so only those are looked at; None: everything. The cases, in the order decided:

        1. A call or a start that ended leaves its sandbox idle.
        2. A sandbox the backend removed is forgotten; a failed start too: its user backs off
           (START_BACKOFF_S) and its user's callers get the error now, not at their deadline
           (each retry re-checks the backend).
        3. An idle sandbox is destroyed if it died, a call left it spent, it has old settings,
           its user went quiet, or it was idle past the TTL beyond its user's min_idle.
        4. A user quiet past the TTL with nothing left is forgotten (plans of everything only).
        5. A caller whose wait ended (cancelled, timed out) leaves the queue.
        6. The waiting callers are served in fair turns (sharing.serve_fairly): their own idle
           sandbox, a start in free room, room on its way, or another user's idle one evicted; at
           max_per_user, their idle one of another access replaced.
        7. A user who called or listed within the TTL gets starts up to min_idle (warm.py), in room outside
           the reserve: never evicting, not while their callers wait (a second start at once
           slows theirs: docker create/start share the CPU), not within a backoff.
        """
        plan = Plan(self._clock())
        if self._closing:
            return plan
        counts, idle_of = self._settle(user, plan)  # 1, 2, 3
        if user is None:
            plan.quiet = self._quiet_users(plan.now)  # 4
        queues = self._queues(plan) if self._waiters else {}  # 5 (and 2's callers)
        if queues:
            self._serve(user, queues, idle_of, counts, plan)  # 6
        self._keep_warm(user, queues, idle_of, counts, plan)  # 7
        return plan

    def _settle(self, user: str | None, plan: Plan) -> tuple[Counts, dict[str, list[PooledSandbox]]]:
        """Cases 1 to 3 for each sandbox looked at; returns the counts after them, and each user's
        sandboxes left idle, in pool order (as case 6 hands them out)."""
        counts = Counts(held={}, starting={}, owned={}, total=len(self._sandboxes), held_total=0, stopping=0)
        idle_of: dict[str, list[PooledSandbox]] = {}
        kept: dict[str, int] = {}  # each account's idle sandboxes kept so far (min_idle counts them together)
        owned, now = counts.owned, plan.now
        for pooled in self._sandboxes if user is None else self._of_user.get(owner_user(user), ()):
            owner, account, state, since = pooled.user, pooled.account, pooled.state, pooled.since
            if pooled.call_ended or (state is STARTING and pooled.sandbox is not None):  # 1
                plan.ready.append(pooled)
                state, since = IDLE, now
            if state is IDLE:
                if self._retired(pooled, since, kept.get(account, 0), now):  # 3
                    plan.destroy.append(pooled)
                    counts.stop(account)
                else:
                    kept[account] = kept.get(account, 0) + 1
                    idle_of.setdefault(owner, []).append(pooled)
            elif state is BUSY:
                counts.hold(account)
            elif gone(pooled, state, plan):  # 2
                counts.total -= 1
                continue
            elif state is STOPPING:
                counts.stop(account)
            else:
                counts.hold(account, starting=owner)
            owned[account] = owned.get(account, 0) + 1
        return counts, idle_of

    def _idle_for_alone(self, user: str, now: float) -> PooledSandbox | None:
        """Case 6 for a caller alone, without a plan: the sandbox a plan of their user would hand them,
        if that is all it would do (test_pool.py checks it against ``_plan``); else None. Nobody else
        waits, the pool is below its ceiling, their sandboxes are busy or fit and idle, and one stays
        idle for min_idle (or none could start). The others it leaves to the next plan, as ``release`` does."""
        if self._waiters or len(self._sandboxes) >= self._ceiling():
            return None
        mine = self._of_user.get(owner_user(user), ())  # their sandboxes of every access: the limits count them all
        first, kept = None, 0
        for pooled in mine:
            if pooled.call_ended:
                since = now  # idle from the plan that settles it (case 1)
            elif pooled.state is IDLE:
                since = pooled.since
            elif pooled.state is BUSY:
                continue
            else:
                return None  # starting or stopping: a plan's case 1 or 2
            if self._retired(pooled, since, kept, now):
                return None  # case 3
            if first is None and pooled.user == user:
                first = pooled
            kept += 1
        if first is None or (kept <= self.config.min_idle and len(mine) < self.config.max_per_user):
            return None  # none idle, or case 7 would start a spare
        return first

    def _retired(self, pooled: PooledSandbox, since: float, kept: int, now: float) -> bool:
        """Case 3: this idle sandbox is destroyed (``kept``: its account's idle ones kept before it).
        The cheapest tests first: this runs at every call's acquire."""
        cfg = self.config
        return (pooled.spent or pooled.generation != self._generation or pooled.sandbox is None
                or not pooled.sandbox.alive or now - self._last_call.get(pooled.user, 0.0) > cfg.idle_ttl_s
                or (kept >= cfg.min_idle and now - since > cfg.idle_ttl_s))

    def _quiet_users(self, now: float) -> list[str]:
        """Case 4: users quiet past the TTL with no sandbox and no caller left (listing costs nothing)."""
        ttl, waiting = self.config.idle_ttl_s, {waiter.user for waiter in self._waiters}
        return [user for user, last in self._last_call.items()
                if now - last > ttl and owner_user(user) not in self._of_user and user not in waiting]

    def _queues(self, plan: Plan) -> dict[str, list[Waiter]]:
        """Case 5, and case 2's callers: each user's callers left waiting, in arrival order."""
        failed = {pooled.user: pooled.start_error for pooled in plan.failed} if plan.failed else {}
        queues: dict[str, list[Waiter]] = {}
        for waiter in self._waiters:
            error = failed.get(waiter.user) if failed else None
            if waiter.future.done():  # cancelled or timed out while queued
                plan.drop.append(waiter)
            elif error is not None:
                plan.fail.append((waiter, error))
            else:
                queues.setdefault(waiter.user, []).append(waiter)
        return queues

    def _serve(self, user: str | None, queues: dict[str, list[Waiter]], idle_of: dict[str, list[PooledSandbox]],
               counts: Counts, plan: Plan) -> None:
        """Case 6: sharing.serve_fairly decides the turns; its decisions go into the plan, and into
        the counts, idle sandboxes and queues that case 7 reads."""
        # A plan of ``user`` alone counts the others' held and stopping sandboxes only near the ceiling
        # (below it, in as many turns as callers wait, no test of the ceiling or of room can be true).
        if user is not None and counts.total + sum(map(len, queues.values())) >= self._ceiling():
            counts.hold_others(owner_user(user), self._sandboxes)
        limits = Limits(self.config.max_per_user, self.config.max_total, self._ceiling())
        arrival = {waiter: i for i, waiter in enumerate(self._waiters)} if len(queues) > 1 else {}
        for decision in serve_fairly(queues, idle_of, arrival, counts, limits):
            if isinstance(decision, Hand):
                plan.hand.append((decision.waiter, decision.sandbox))
                idle_of[decision.sandbox.user].remove(decision.sandbox)
                queues[decision.waiter.user].remove(decision.waiter)
            elif isinstance(decision, Start):
                plan.start.append(counts.started(decision.user))
            else:
                plan.destroy.append(decision.sandbox)
                idle_of[decision.sandbox.user].remove(decision.sandbox)
                if isinstance(decision, Replace):  # both at once: the new one takes the old one's place
                    plan.start.append(counts.started(decision.user))

    def _keep_warm(self, user: str | None, queues: dict[str, list[Waiter]], idle_of: dict[str, list[PooledSandbox]],
                   counts: Counts, plan: Plan) -> None:
        """Case 7, for each account active within the TTL (or the one looked at): its idle sandboxes of every
        access count together, and a spare is of the access used last (a listing's, or the last call's)."""
        cfg, now = self.config, plan.now
        if cfg.min_idle == 0:  # nothing to keep warm
            return
        backing_off = {pooled.user for pooled in plan.failed} if plan.failed else ()
        waiting = {owner_user(owner) for owner, callers in queues.items() if callers}
        idle = idle_by_account(idle_of)
        owners = self._last_call if user is None else [user, *(p.user for p in self._of_user.get(owner_user(user), ()))]
        for account, active in used_last(owners, self._last_call).items():
            if account in waiting or active in backing_off or not self._wants_spare(active, idle[account], now):
                continue
            for _ in range(cfg.min_idle - idle[account] - counts.warming.get(account, 0)):
                if counts.owned.get(account, 0) >= cfg.max_per_user or counts.total >= self._ceiling():
                    break
                plan.start.append(counts.started(active))

    def _wants_spare(self, user: str, idle: int, now: float) -> bool:
        """Case 7's owner: active within the TTL, its account short of min_idle (``idle``), past any backoff."""
        cfg = self.config
        return (idle < cfg.min_idle and now - self._last_call.get(user, 0.0) <= cfg.idle_ttl_s
                and now >= self._backoff_until.get(user, 0.0))

    # -- applying a plan: the state, then the I/O ------------------------------

    def _apply(self, plan: Plan) -> Plan:
        if plan:  # the common empty plan: a plan of a user whose sandboxes did not change
            self._act(plan, self._commit(plan))
        return plan

    def _commit(self, plan: Plan) -> list[PooledSandbox]:
        """Apply ``plan`` to the pool's state; returns the records of the sandboxes to start."""
        now = plan.now
        for pooled in plan.ready:
            pooled.state, pooled.since, pooled.call_ended = IDLE, now, False
        for pooled in plan.forget:
            self._forget(pooled)
        for pooled in plan.failed:
            self._forget(pooled)
            self._backoff_until[pooled.user] = now + START_BACKOFF_S
        for pooled in plan.destroy:
            if not pooled.alive and not pooled.spent:
                self.stats["crashed"] += 1  # died while idle (a spent one was counted at its release)
            pooled.state, pooled.since = STOPPING, now
        for quiet in plan.quiet:
            del self._last_call[quiet]
        self._commit_waiters(plan)
        return [self._new(user, now) for user in plan.start]

    def _commit_waiters(self, plan: Plan) -> None:
        for _waiter, pooled in plan.hand:
            pooled.state, pooled.since = BUSY, plan.now
        leaving = len(plan.drop) + len(plan.fail) + len(plan.hand)  # each a different one of _waiters
        if leaving == len(self._waiters):
            self._waiters.clear()  # all of them: the common call, its one caller served at once
        elif leaving:
            gone = {*plan.drop, *(waiter for waiter, _ in plan.fail), *(waiter for waiter, _ in plan.hand)}
            self._waiters[:] = [waiter for waiter in self._waiters if waiter not in gone]

    def _act(self, plan: Plan, started: list[PooledSandbox]) -> None:
        """The plan's I/O, once the state is settled: tell the callers, then start and destroy."""
        for waiter, pooled in plan.hand:
            waiter.future.set_result(pooled)
        for waiter, error in plan.fail:
            waiter.future.set_exception(error)
        for pooled in started:
            task = self._spawn(self._start(pooled))
            self._starts.add(task)
            task.add_done_callback(self._starts.discard)
        for pooled in plan.destroy:  # idle ones only: each has its sandbox
            self._spawn(self._destroy(pooled))

    def _refusal(self, user: str, timeout: float) -> Overloaded:
        """Why ``user``'s wait ran out (sharing.refusal), counted by reason."""
        account = owner_user(user)
        reason, why = refusal(account, self._of_user.get(account, []), self._sandboxes, self.config)
        self.refusals[reason] += 1
        return Overloaded(f"no sandbox for {account} became free within {timeout:g} s: {why}; retry later.",
                          data={"pool": repr(self), "reason": reason})

    def _forget(self, pooled: PooledSandbox) -> None:
        self._sandboxes.remove(pooled)
        mine = self._of_user[pooled.account]
        mine.remove(pooled)
        if not mine:
            del self._of_user[pooled.account]

    def _new(self, user: str, now: float) -> PooledSandbox:
        pooled = PooledSandbox(user, STARTING, since=now, generation=self._generation)
        self._sandboxes.append(pooled)
        self._of_user.setdefault(pooled.account, []).append(pooled)
        return pooled

    # -- side effects -------------------------------------------------------

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
        if pooled.current is IDLE:
            self._replan(pooled.user)
        # A busy one is handled by its call, which sees the failure and releases it as not reusable.

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

