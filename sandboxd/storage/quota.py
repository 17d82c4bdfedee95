"""Each user's share of the disk: where the kernel enforces it, and what the daemon measures.

Two places hold what a user's sandboxes write that outlives a call: DATA_PATH/<user>
("data") and the user's email folder ("email"). For each, at start-up:

- hard: the filesystem is btrfs with quota on, and the daemon is root or the helper
  (helper.py) answers: each user folder is a subvolume, and one qgroup per user holds them
  and carries ``quota_bytes``; the kernel fails a write past it with EDQUOT. btrfs has no
  file-count limit: files are metadata bytes, which the qgroup counts, so they are bounded
  by it too. Nothing refuses calls: the kernel stops writes, and deletes still work;
- soft: usage is measured (usage.py) after each call and on an interval, in a worker
  thread; a user over quota is refused new calls until they hold less.

``auto`` takes hard where it can and says once which places fall back; ``hard`` stops
start-up (exit 2) where it cannot, naming the fix.
"""

from __future__ import annotations

import asyncio
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from typing import Any, Callable, Iterable, Literal

from sandboxd.config import Config
from sandboxd.errors import ConfigError, QuotaExceeded
from sandboxd.helper_client import ask_helper
from sandboxd.logging import get_logger
from sandboxd.storage import btrfs
from sandboxd.storage.provision import SANDBOX_PATHS, Area, areas, hard_problem, provision_user
from sandboxd.storage.usage import Usage, measure
from sandboxd.storage.walks import MIN_SPACING_S, Walks, users_on_disk

log = get_logger("sandboxd.storage")

Mode = Literal["hard", "soft", "off"]
OVER_RECHECK_S = 5.0  # how soon a user refused for their usage is let in again after cleaning up


@dataclass(frozen=True)
class Place:
    """How an area is enforced on this host."""

    area: Area
    mode: Mode
    how: str  # for the log and sandbox/status
    fs_id: str | None = None  # the btrfs filesystem, when hard


@dataclass(frozen=True)
class UserUsage:
    usage: Usage
    limit_bytes: int
    limit_inodes: int
    bytes_hard: bool  # the kernel holds this user's bytes (else they are measured)
    measured_at: float

    @property
    def over_bytes(self) -> bool:
        # What the walk could not read is of unknown size: over, never nothing.
        return not self.bytes_hard and (self.usage.bytes > self.limit_bytes or self.usage.unreadable is not None)

    @property
    def over_inodes(self) -> bool:
        # Hard: files are metadata bytes the qgroup limits; a refusal would only stop the calls that delete them.
        return not self.bytes_hard and self.usage.inodes > self.limit_inodes

    def at_bytes_limit(self) -> bool:
        """Within 5 % (at least 1 MiB) of the byte limit: where btrfs fails writes (it reserves ahead)."""
        return self.usage.bytes >= self.limit_bytes - max(1 << 20, self.limit_bytes // 20)


def size_text(n: int) -> str:
    """Bytes for a person: 12.0 MiB."""
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n} B"


class Storage:
    """Enforces and measures each user's quota for the daemon (server.Server owns one)."""

    def __init__(self, config: Config, *, on_over: Callable[[str], None] | None = None,
                 live_users: Callable[[], Iterable[str]] = tuple) -> None:
        self.config = config
        self.places: list[Place] = []
        self.refusals = 0
        self.walks = 0  # of users' folders (sandbox/status: storage.walks), each user's at most one a second
        self._usage: dict[str, UserUsage] = {}
        # Users whose last figures are over quota: a call's path asks this set, no method call, twice per call.
        # Changed in place only (``_keep``), so a holder of it sees each change.
        self.over_quota: set[str] = set()
        self._provisioned: dict[str, dict[str, str]] = {}
        self._provisioning: dict[str, threading.Lock] = {}  # one per user provisioned
        self._lock = threading.Lock()
        self._via_helper = False
        # One thread: measuring never takes more than one core's share, and never the event loop.
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="sandboxd-quota")
        self._walks: Walks[UserUsage] = Walks(self._executor, self.measure_now, self._walked)
        self._unreadable_logged: dict[str, str] = {}
        # The server's: a user measured over quota (soft) has every sandbox that ran a tool destroyed,
        # and users with sandboxes are measured every second, so a writer left behind is seen.
        self.on_over = on_over
        self.live_users = live_users
        self._loop: asyncio.AbstractEventLoop | None = None
        self._task: asyncio.Task[None] | None = None

    @property
    def enabled(self) -> bool:
        return self.config.storage.enforcement != "off"

    @property
    def hard(self) -> bool:
        return any(place.mode == "hard" for place in self.places)

    # -- start-up ----------------------------------------------------------------

    def resolve(self) -> None:
        """Decide, per area, what enforces the quota; log it. ConfigError when ``hard`` cannot be had (blocking)."""
        storage = self.config.storage
        wanted = storage.enforcement
        if wanted == "off":
            self.places = [Place(area, "off", "no quota (storage.enforcement: off)") for area in areas(self.config)]
            log.warning("storage_quota_off", detail="users' folders may fill the disk: set storage.enforcement: auto")
            return
        for area in areas(self.config):
            if area.name == "email" and area.per_user_root and area.root.is_relative_to(self.config.data_path):
                area.root.mkdir(mode=0o700, parents=True, exist_ok=True)  # as mounts.py would make it
        privileged, helper_problem = self._privilege()
        places, problems = [], []
        for area in areas(self.config):
            problem, fs_id = (hard_problem(area, privileged=privileged) if wanted != "soft"
                              else ("storage.enforcement is soft", None))
            if problem is None:
                places.append(Place(area, "hard", "btrfs qgroup (bytes, files' metadata included); calls never refused"
                                    + (" (through sandboxd-quota helper)" if self._via_helper else ""), fs_id))
            else:
                if helper_problem and "needs root" in problem:
                    problem += f" ({helper_problem})"
                places.append(Place(area, "soft", f"measured after each call; refused over quota ({problem})"))
                if wanted != "soft":
                    problems.append(f"{area.name} folders ({area.root}): {problem}")
        if problems and wanted == "hard":
            raise ConfigError("storage.enforcement is hard, and the kernel cannot enforce the quota for "
                              + "; ".join(problems) + ". Fix that, or set storage.enforcement: auto or soft.")
        self.places = places
        for place in places:
            log.info("storage_enforcement", area=place.area.name, path=str(place.area.root), enforcement=place.mode,
                     how=place.how, quota_bytes=storage.quota_bytes, quota_inodes=storage.quota_inodes)
        if problems:
            log.warning("storage_quota_soft", places=problems,
                        detail="usage is measured, not enforced by the kernel: a user can go over quota within a "
                               "call, and is refused further calls until under it (docs/install.md, 'Disk quotas')")

    def _privilege(self) -> tuple[bool, str | None]:
        """(whether qgroups can be set, why the helper cannot when it was tried)."""
        if os.geteuid() == 0:
            return True, None
        path = self.config.storage.helper_socket
        try:
            ask_helper(path, {"op": "check"})
        except (OSError, ValueError) as exc:
            return False, f"the helper at {path} did not answer: {exc}"
        self._via_helper = True
        return True, None

    async def start(self) -> None:
        """Measure every user once, then on the interval (a task on the running loop)."""
        self._loop = asyncio.get_running_loop()
        if self.enabled:
            self._task = self._loop.create_task(self._measure_periodically())

    def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
        self._executor.shutdown(wait=False, cancel_futures=True)

    # -- folders (called in the backend's worker thread, before a sandbox mounts them) --

    def provision(self, user: str) -> None:
        """Make ``user``'s folders under their quota (a plain one converted); BackendUnavailable-worthy OSError
        on failure. Once per daemon run, again if a folder was replaced meanwhile."""
        if not self.hard or (user in self._provisioned and self._still_limited(user)):
            return
        with self._provision_lock(user):  # per user: one's folder converting (a copy) holds up no one else
            if user in self._provisioned and self._still_limited(user):
                return
            if self._via_helper:
                try:
                    done = ask_helper(self.config.storage.helper_socket, {"op": "provision", "user": user})["areas"]
                except ValueError as exc:  # the helper's own answer: what went wrong, and its fix
                    raise OSError(f"the quota helper could not prepare {user}'s folders: {exc}") from None
                except (OSError, KeyError) as exc:
                    raise OSError(f"the quota helper could not prepare {user}'s folders ({exc}); "
                                  "check `systemctl status sandboxd-quota.socket`") from None
            else:
                done = provision_user(self.config, user, (os.getuid(), os.getgid()))
            self._provisioned[user] = done

    def _provision_lock(self, user: str) -> threading.Lock:
        with self._lock:
            return self._provisioning.setdefault(user, threading.Lock())

    def _still_limited(self, user: str) -> bool:
        """False when a folder under the quota is gone or is no longer a subvolume (an operator removed or
        replaced it, by ``mkdir`` say): it is made again, or converted, under the quota."""
        done = self._provisioned.get(user, {})
        for area in areas(self.config):
            if not done.get(area.name, "").startswith("hard:"):
                continue
            try:
                if os.lstat(area.folder(self.config, user)).st_ino != btrfs.SUBVOLUME_ROOT_INO:
                    raise FileNotFoundError
            except FileNotFoundError:
                self._provisioned.pop(user, None)
                return False
        return True

    # -- usage -------------------------------------------------------------------

    def _limits(self, user: str) -> tuple[int, int]:
        return self.config.storage.limits(user)

    def _kernel_group(self, user: str) -> tuple[bool, tuple[str, int] | None]:
        """(whether the kernel holds ``user``'s bytes, and the (fs id, qgroup) that counts them if one does)."""
        done = self._provisioned.get(user)
        if done is None:  # no sandbox yet: its folders are made under the quota when the first one starts
            return all(place.mode == "hard" for place in self.places), None
        hard = [state for state in done.values() if state.startswith("hard:")]
        if len(hard) != len(done):
            return False, None
        if len(set(hard)) != 1:
            return True, None
        _, fs_id, group = hard[0].split(":")
        return True, (fs_id, int(group))

    def measure_now(self, user: str) -> UserUsage:
        """Measure ``user``'s folders (blocking: a worker thread) and keep the figures."""
        limit_bytes, limit_inodes = self._limits(user)
        folders = [area.folder(self.config, user) for area in areas(self.config)]
        usage = measure(folders, limit_inodes)
        self.walks += 1
        bytes_hard, group = self._kernel_group(user)
        kernel = btrfs.qgroup_usage(*group) if group is not None else None
        if kernel is not None:  # what the kernel holds against the limit
            usage = Usage(kernel[0], usage.inodes, usage.complete, usage.unreadable)
        record = UserUsage(usage, limit_bytes, limit_inodes, bytes_hard, time.monotonic())
        self._keep(user, record)
        return record

    def _keep(self, user: str, record: UserUsage) -> None:
        """``user``'s figures now, and whether they are over quota (see ``over_quota``)."""
        self._usage[user] = record
        if record.over_bytes or record.over_inodes:
            self.over_quota.add(user)
        else:
            self.over_quota.discard(user)

    def _kernel_record(self, user: str) -> UserUsage | None:
        """Hard mode: ``user``'s bytes as the qgroup counts them (no walk; files as last measured). None if soft."""
        _, group = self._kernel_group(user)
        kernel = btrfs.qgroup_usage(*group) if group is not None else None
        if kernel is None:
            return None
        limit_bytes, limit_inodes = self._limits(user)
        last = self._usage.get(user)
        inodes = last.usage.inodes if last is not None else 0
        return UserUsage(Usage(kernel[0], inodes, last is not None), limit_bytes, limit_inodes, True, time.monotonic())

    def after_call(self, user: str) -> None:
        """A call of ``user`` ended: measure them again, soon. Hard mode: no walk (the kernel holds the bytes)."""
        if not self.enabled:  # no quota: a call ends without a look at the user's folders
            return
        if not self._kernel_group(user)[0]:
            self.measure_soon(user)
        elif user not in self._usage:  # status lists a hard user from their first call, not the next full pass
            record = self._kernel_record(user)
            if record is not None:
                self._keep(user, record)

    def measure_soon(self, user: str) -> None:
        """Walk ``user``'s folders soon, off the loop (walks.py: at most one walk a second per user, shared)."""
        if not self.enabled:
            return
        try:
            self._walks.next(user)
        except RuntimeError:  # no running loop (a test): measured now, in the thread
            self._executor.submit(self.measure_now, user)

    def _walked(self, user: str, walked: asyncio.Future[UserUsage]) -> None:
        """After each walk, on the loop: a user over quota (measured) keeps no writer; what could not be read is logged."""
        if walked.cancelled():
            return
        if walked.exception() is not None:
            log.error("storage_measure_failed", user=user, error=repr(walked.exception()))
            return
        record = walked.result()
        unreadable = record.usage.unreadable
        if unreadable is not None and self._unreadable_logged.get(user) != unreadable:
            self._unreadable_logged[user] = unreadable
            log.warning("storage_unreadable", user=user, path=unreadable,
                        detail="sandboxd cannot read this, so its size is unknown and the user counts as over quota; "
                               "make it readable to sandboxd's user, or delete it")
        if (record.over_bytes or record.over_inodes) and self.on_over is not None:
            self.on_over(user)

    async def _measure_periodically(self) -> None:
        last_full = last_over = 0.0
        interval = self.config.storage.measure_interval_s
        while True:
            now = time.monotonic()
            if now - last_full >= interval:
                last_full = now
                for user in await asyncio.to_thread(users_on_disk, self.config.data_path):
                    record = self._usage.get(user)
                    # Measured since the last pass (after a call): their figures are current.
                    if record is None or time.monotonic() - record.measured_at >= interval:
                        self.measure_soon(user)
            elif now - last_over >= min(OVER_RECHECK_S, interval):
                last_over = now
                for user, record in list(self._usage.items()):
                    if record.over_bytes or record.over_inodes:
                        self.after_call(user)
            for user in self.live_users():  # a writer left running in a sandbox is seen within a second or two
                self.after_call(user)
            await asyncio.sleep(MIN_SPACING_S)

    # -- calls -------------------------------------------------------------------

    def refusal(self, user: str) -> QuotaExceeded | None:
        """The error a new call of ``user`` gets while their last measurement is over quota; None to let it run."""
        record = self._usage.get(user)
        if record is None or not (record.over_bytes or record.over_inodes):
            return None
        self.refusals += 1
        self.after_call(user)  # measured again now: a user who cleaned up is let in at the next call
        usage = record.usage
        if usage.unreadable is not None and record.over_bytes and usage.bytes <= record.limit_bytes:
            what = (f"hold {usage.unreadable}, which sandboxd cannot read: their usage is unknown, so it counts as "
                    "over quota until that is made readable to sandboxd's user or deleted")
        elif record.over_bytes:
            what = (f"hold {size_text(usage.bytes)}, over their quota of {size_text(record.limit_bytes)} "
                    "(storage.quota_bytes)")
        else:
            what = (f"hold {usage.inodes}{'+' if not usage.complete else ''} files and folders, over their quota of "
                    f"{record.limit_inodes} (storage.quota_inodes)")
        biggest = self._in_sandbox(user, usage.biggest)
        named = ", ".join(f"{path} ({size_text(size)})" for path, size in biggest)
        return QuotaExceeded(
            f"{user}'s folders (/officer/user and /officer/data in a sandbox) {what}; new calls are refused until "
            f"they hold less. Delete files there{'; the biggest: ' + named if named else ''}. The operator: "
            f"`sandboxd storage free {user} {biggest[0][0] if biggest else 'PATH'}` (docs/install.md, 'Disk "
            "quotas'), or raise the quota (storage.users in the configuration).",
            data={"user": user, "bytes": usage.bytes, "limitBytes": record.limit_bytes, "inodes": usage.inodes,
                  "limitInodes": record.limit_inodes, "biggest": [{"path": p, "bytes": n} for p, n in biggest]},
        )

    def _in_sandbox(self, user: str, entries: tuple[tuple[str, int], ...]) -> list[tuple[str, int]]:
        """Host paths of a user's entries as their sandboxes see them (/officer/user/..., /officer/data/...)."""
        mounts = {str(area.folder(self.config, user)): SANDBOX_PATHS[area.name] for area in areas(self.config)}
        shown = []
        for path, size in entries:
            folder, _, name = path.rpartition("/")
            shown.append((f"{mounts[folder]}/{name}" if folder in mounts else path, size))
        return shown

    async def note(self, user: str) -> str | None:
        """After a call that failed on a full disk: which quota it hit and how to free space; None if none is full."""
        if not self.enabled:
            return None
        try:  # hard: the qgroup's figure; soft: the next walk, shared with every call that failed meanwhile
            record = self._kernel_record(user)
            if record is None:
                record = await asyncio.shield(self._walks.next(user))
        except Exception:  # the daemon is stopping, or the walk failed (logged)
            return None
        usage = record.usage
        if record.at_bytes_limit():
            what = f"hold {size_text(usage.bytes)} of their {size_text(record.limit_bytes)} quota (storage.quota_bytes)"
        elif usage.inodes >= record.limit_inodes:
            what = f"hold {usage.inodes} files and folders, their quota (storage.quota_inodes)"
        else:
            return None
        refused = " New calls are refused while over quota." if record.over_bytes or record.over_inodes else ""
        return (f"sandboxd: this user's folders (/officer/user and /officer/data) {what}, so writes fail (EDQUOT or "
                f"ENOSPC). Delete files there to free space; the sandbox still works.{refused}")

    # -- status ------------------------------------------------------------------

    def status(self) -> dict[str, Any]:
        now = time.monotonic()
        for user, record in list(self._usage.items()):  # hard: the qgroup's bytes now, files as last walked
            if record.bytes_hard and (kernel := self._kernel_record(user)) is not None:
                self._keep(user, replace(record, usage=replace(record.usage, bytes=kernel.usage.bytes)))
        return {
            "enforcement": [{"area": p.area.name, "path": str(p.area.root), "mode": p.mode, "how": p.how}
                            for p in self.places],
            "refusals": self.refusals,
            "walks": self.walks,
            "users": {user: {"bytes": r.usage.bytes, "limitBytes": r.limit_bytes, "inodes": r.usage.inodes,
                             "limitInodes": r.limit_inodes, "bytesEnforcedByKernel": r.bytes_hard,
                             "over": r.over_bytes or r.over_inodes, "measuredAgoS": round(now - r.measured_at, 1)}
                      for user, r in sorted(self._usage.items())},
        }
