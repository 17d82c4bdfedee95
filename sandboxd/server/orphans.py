"""The sandboxes an earlier run on this data path left, removed at start-up (``OrphanSweep``).

Their instance label is the data path's hash (server.instance_id), so a daemon removes its own
orphans and never another's. An engine that does not answer yet is asked again each maintenance tick.
"""

from __future__ import annotations

from pathlib import Path

from sandboxd.logging import get_logger
from sandboxd.sandbox.backend import Backend

log = get_logger("sandboxd.server")


class OrphanSweep:
    def __init__(self, backend: Backend, data_path: Path) -> None:
        self._backend = backend
        self._data_path = data_path
        self.done = False
        self.reaped = 0  # containers removed so far (the metrics' sandboxd_orphans_reaped)
        self._warned = False

    async def sweep(self) -> None:
        try:
            removed = await self._backend.remove_orphans()
        except Exception as exc:
            # Retried every maintenance tick until the engine answers; said once.
            if not self._warned:
                log.warning("orphan_cleanup_deferred", error=str(exc))
                self._warned = True
            return
        self.done = True
        self.reaped += removed
        if removed:
            log.info("orphans_removed", count=removed, data_path=str(self._data_path),
                     reason="sandboxes an earlier run on this data path left (their instance label is its hash)")
