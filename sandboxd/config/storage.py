"""The storage section: each user's disk quota (sandboxd/storage/ enforces it)."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from pydantic import Field, field_validator

from sandboxd.config.sections import Section
from sandboxd.errors import InvalidParams
from sandboxd.users import check_user


_SIZE_UNITS = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}


def parse_size(value: Any) -> int:
    """A size in bytes: a whole number, or one with a binary unit like docker's (``512k``, ``20m``, ``5g``, ``1t``)."""
    if isinstance(value, bool):
        raise ValueError(f"{value!r} is not a size; write a number of bytes or one with a unit, e.g. '5g' or '500m'")
    if isinstance(value, int):
        if value < 0:
            raise ValueError(f"{value} is a negative size")
        return value
    if isinstance(value, str):
        text = value.strip().lower().removesuffix("ib").removesuffix("b")
        number, unit = (text[:-1], text[-1]) if text[-1:] in ("k", "m", "g", "t") else (text, "")
        if number.replace(".", "", 1).isdigit():
            return int(float(number) * _SIZE_UNITS[unit])
    raise ValueError(f"{value!r} is not a size; write a number of bytes or one with a unit k, m, g or t "
                     "(powers of 1024), e.g. '5g' or '500m'")


Enforcement = Literal["off", "soft", "hard", "auto"]


class UserQuota(Section):
    quota_bytes: int | None = Field(None, description="This user's byte quota; null = storage.quota_bytes.")
    quota_inodes: int | None = Field(None, ge=1, description="This user's file count quota; null = storage.quota_inodes.")

    @field_validator("quota_bytes", mode="before")
    @classmethod
    def _size(cls, value: Any) -> Any:
        return None if value is None else parse_size(value)


class StorageConfig(Section):
    # E2B gives a sandbox 1-5 GB, Daytona 3 GiB: the upper end, for a user's data and mail together.
    quota_bytes: int = Field(5 << 30, ge=1 << 20, description="Bytes one user's folders (DATA_PATH/<user> and the email folder) may hold together, as a size like '5g' or '500m'.")
    quota_inodes: int = Field(500_000, ge=100, description="Files and folders one user's folders may hold together.")
    enforcement: Enforcement = Field("auto", description="off = no quota; soft = usage measured after each call and on an interval, a user over quota is refused new calls and their sandboxes replaced; hard = the kernel stops writes at the limit (btrfs qgroups; start-up stops where it cannot); auto = hard where the filesystem allows it, else soft, said once at start.")
    measure_interval_s: float = Field(60.0, gt=0, description="How often each user's usage is measured besides after their calls (users over quota: every few seconds; soft mode, users with sandboxes: every second).")
    helper_socket: Path = Field(Path("/run/sandboxd-quota.sock"), description="The privileged quota helper's socket (sandboxd-quota.socket), used when the daemon does not run as root.")
    users: dict[str, UserQuota] = Field(default_factory=dict, description="Per-user quotas: user email -> {quota_bytes, quota_inodes}; what a user's entry leaves out is the default.")

    @field_validator("quota_bytes", mode="before")
    @classmethod
    def _size(cls, value: Any) -> Any:
        return parse_size(value)

    @field_validator("enforcement", mode="before")
    @classmethod
    def _unquoted_off(cls, value: Any) -> Any:
        return "off" if value is False else value  # YAML 1.1 reads an unquoted off as false

    @field_validator("users", mode="before")
    @classmethod
    def _user_names(cls, value: Any) -> Any:
        if isinstance(value, dict):
            checked = {}
            for name, limits in value.items():
                try:
                    checked[check_user(name)] = limits
                except InvalidParams as exc:
                    raise ValueError(f"storage.users: {exc.message}") from None
            return checked
        return value

    def limits(self, user: str) -> tuple[int, int]:
        """(bytes, inodes) ``user`` may hold."""
        own = self.users.get(user)
        if own is None:
            return self.quota_bytes, self.quota_inodes
        return (own.quota_bytes if own.quota_bytes is not None else self.quota_bytes,
                own.quota_inodes if own.quota_inodes is not None else self.quota_inodes)
