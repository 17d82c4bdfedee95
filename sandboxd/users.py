"""Users are email addresses; each owns DATA_PATH/<user>/ and its sandboxes."""

from __future__ import annotations

import re
from pathlib import Path

from sandboxd.errors import InvalidParams

# Used with fullmatch: "$" would let "alice@example.com\n" through as another user.
_USER_RE = re.compile(r"[A-Za-z0-9._%+-]+@[A-Za-z0-9.-]+")
MAX_USER_LENGTH = 254
# Names already checked, to their canonical form: a client names the same few users call after call.
# Bounded: a client naming endless users only refills it.
_CHECKED: dict[str, str] = {}
_MAX_CHECKED = 10_000


def check_user(user: object) -> str:
    """The user's canonical (lower-case) name if ``user`` is well-formed, else raise InvalidParams.

    Lower-cased so that "Alice@Example.com" and "alice@example.com" are one user with one
    directory and one pool, even on a case-insensitive filesystem (docs/protocol.md#users).
    """
    # Only exact strings are remembered: a subclass of str may hash and compare as it likes.
    if type(user) is str and (canonical := _CHECKED.get(user)) is not None:
        return canonical
    if user is None or user == "":
        raise InvalidParams("'user' is required: pass the user's email address, e.g. \"alice@example.com\".")
    if not isinstance(user, str):
        raise InvalidParams("'user' must be a string: the user's email address, e.g. \"alice@example.com\".")
    if len(user) > MAX_USER_LENGTH:
        raise InvalidParams(f"'user' is {len(user)} characters long; an email address has at most {MAX_USER_LENGTH}.")
    # ".." is refused before the pattern so that no user name can climb out of DATA_PATH.
    if ".." in user or not _USER_RE.fullmatch(user):
        raise InvalidParams(f"'user' {user!r} is not an email address like \"alice@example.com\".")
    canonical = user.lower()
    if type(user) is str:
        if len(_CHECKED) >= _MAX_CHECKED:
            _CHECKED.clear()
        _CHECKED[user] = canonical
    return canonical


def user_dir(data_path: Path, user: str) -> Path:
    return data_path / check_user(user)


def user_tools_dir(data_path: Path, user: str) -> Path:
    return user_dir(data_path, user) / "tools"


def global_tools_dir(data_path: Path) -> Path:
    return data_path / "tools"
