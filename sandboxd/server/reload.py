"""What a reload changes: the keys that apply live, those that need a restart, and the configuration after it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from sandboxd.config import Config, flatten, needs_restart


@dataclass(frozen=True)
class ConfigChange:
    config: Config  # the new configuration, with every restart-only key as it runs now
    applied: list[str]
    needs_restart: list[str]

    def touches(self, section: str) -> bool:
        """Whether a key of ``section`` (e.g. "sandbox") applies live in this change."""
        return any(key.startswith(f"{section}.") for key in self.applied)


def config_change(running: Config, new: Config) -> ConfigChange:
    old_values, new_values = flatten(running), flatten(new)
    changed = [key for key, value in new_values.items() if old_values.get(key) != value]
    applied = [key for key in changed if not needs_restart(key)]
    kept = [key for key in changed if needs_restart(key)]
    if not kept:
        return ConfigChange(new, applied, kept)
    merged: dict[str, Any] = new.model_dump()
    for key in kept:  # dotted keys, as flatten() makes them
        *sections, leaf = key.split(".")
        target = merged
        for section in sections:
            target = target[section]
        target[leaf] = old_values[key]
    return ConfigChange(Config.model_validate(merged), applied, kept)
