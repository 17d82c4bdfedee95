"""Where things live inside a sandbox (docs/tools.md): the /officer paths and the env every sandbox gets.

A leaf: the backends mount and set these, the transpile cache and storage name them, and a
call's env may not override them.
"""

from __future__ import annotations

CONTAINER_TOOLS = "/officer/tools"
CONTAINER_USER = "/officer/user"
CONTAINER_USER_TOOLS = "/officer/user/tools"
CONTAINER_EMAIL_DIR = "/officer/data"  # the host folder of the user's email database, read-write
CONTAINER_EMAIL_DB = f"{CONTAINER_EMAIL_DIR}/emails.db"
CONTAINER_CACHE = "/officer/cache"  # the transpile cache (tools/transpile_cache.py), read-only


def sandbox_env(*, home: str, tools_dir: str, user_tools_dir: str, email_db: str) -> dict[str, str]:
    """The variables every sandbox gets (docs/tools.md, "The entry file"), by any backend."""
    return {
        "HOME": home,
        "OFFICER_USER_HOME": home,
        "OFFICER_USER_ROOT": home,
        "PI_TOOLS_DIRS": f"{tools_dir}:{user_tools_dir}",
        "OFFICER_EMAIL_DB": email_db,
    }


# Names a call's env may never set, even when calls.allowed_env lists them: the contract above,
# the shim's own (SANDBOXD_*, checked by prefix) and the egress proxy variables the shim sets.
RESERVED_ENV = frozenset(sandbox_env(home="", tools_dir="", user_tools_dir="", email_db="")) | frozenset(
    {"HTTP_PROXY", "HTTPS_PROXY", "http_proxy", "https_proxy", "NO_PROXY", "no_proxy", "ALL_PROXY", "all_proxy"})


def reserved_env(name: str) -> bool:
    return name in RESERVED_ENV or name.startswith("SANDBOXD_")
