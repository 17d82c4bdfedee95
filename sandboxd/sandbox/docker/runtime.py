"""The OCI runtime a sandbox runs under (``sandbox.runtime``), as the engine has it registered.

gVisor (runsc) puts a kernel of its own between a tool and the host's (docs/security.md).
sandboxd needs it registered with two flags (scripts/ensure-gvisor.sh does it):
``--network=none`` (a sandbox has no network; without it runsc refuses to start in the
root network namespace) and ``--host-uds=open`` (the shim and the egress proxy are unix
sockets bind-mounted into the sandbox; without it connecting to them fails with EPERM).
"""

from __future__ import annotations

import os
import shutil
from typing import Any

GVISOR_FIX = "run `sudo make gvisor` (scripts/ensure-gvisor.sh; docs/install.md, \"gVisor\")"
# Each flag sandboxd needs, with the values that satisfy it.
GVISOR_FLAGS = {"network": ("none",), "host-uds": ("open", "all")}


def _registered(info: dict[str, Any], runtime: str) -> dict[str, Any] | None:
    runtimes = info.get("Runtimes") or {}
    found = runtimes.get(runtime)
    return found if isinstance(found, dict) else None


def is_gvisor(info: dict[str, Any], runtime: str | None) -> bool:
    """Whether ``runtime`` is gVisor's runsc, under whatever name it is registered."""
    if runtime is None:
        return False
    registered = _registered(info, runtime)
    path = str(registered.get("path") or "") if registered else ""
    return os.path.basename(path) == "runsc" or (registered is None and runtime == "runsc")


def _flags(args: list[Any]) -> dict[str, str]:
    """``--name=value`` (or ``-name=value``, as Go's flag package also reads) arguments by name."""
    flags = {}
    for arg in args:
        name, equals, value = str(arg).lstrip("-").partition("=")
        flags[name] = value if equals else "true"
    return flags


def runtime_problem(info: dict[str, Any], runtime: str | None, *, local: bool) -> str | None:
    """Why the engine (its ``docker info``) cannot run sandboxes under ``runtime``, or None.

    ``local``: the engine runs on this host, so its runtime's binary can be looked for here.
    """
    if runtime is None:
        return None
    registered = _registered(info, runtime)
    gvisor = is_gvisor(info, runtime)
    if registered is None:
        fix = GVISOR_FIX if gvisor else f"register it in the engine's daemon.json (\"runtimes\") or unset sandbox.runtime"
        return f"sandbox.runtime is {runtime!r}, which the Docker engine does not know; {fix}"
    path = str(registered.get("path") or "")
    if local and path and shutil.which(path) is None:
        fix = GVISOR_FIX if gvisor else "install it, or unset sandbox.runtime"
        return f"sandbox.runtime {runtime!r} is registered with the Docker engine as {path}, which is not on this host; {fix}"
    if not gvisor:
        return None
    flags = _flags(list(registered.get("runtimeArgs") or []))
    missing = [f"--{name}={values[0]}" for name, values in GVISOR_FLAGS.items() if flags.get(name) not in values]
    if missing:
        return (f"sandbox.runtime {runtime!r} (gVisor) is registered without {' '.join(missing)}, which sandboxd "
                f"needs (no network in a sandbox; its unix sockets); {GVISOR_FIX}")
    return None
