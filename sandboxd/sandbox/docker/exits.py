"""Why a Docker sandbox ended, in words an agent can act on."""

from __future__ import annotations

import time
from typing import Any

import docker

OOM_EVENT_WAIT_S = 0.5  # how long after the exit an 'oom' event the engine has not logged yet may still come
OOM_EVENT_SINCE_S = 600  # how far back the engine's event log is read for it (a call's kill is seconds old)


def exit_state(api: docker.APIClient, container_id: str) -> dict[str, Any]:
    """The engine's ``State`` of an ended container, ``OOMKilled`` also true when the engine logged an 'oom' for it.

    Docker 20.10 copies the kernel's OOM event into ``OOMKilled`` only when it reaches the engine before
    the exit; a busy engine sees them the other way round, and an out-of-memory kill then reads as a bare
    SIGKILL (CI saw it three times in one run). The 'oom' event is logged either way.
    """
    state: dict[str, Any] = api.inspect_container(container_id).get("State") or {}
    if state.get("ExitCode") == 137 and not state.get("OOMKilled") and not state.get("Running"):
        now = time.time()
        # The engine reads "seconds.nanoseconds": nine digits, or ".5" would be five nanoseconds.
        events = api.events(since=int(now - OOM_EVENT_SINCE_S), until=f"{now + OOM_EVENT_WAIT_S:.9f}", decode=True,
                            filters={"container": container_id, "event": "oom"})
        state = {**state, "OOMKilled": any(True for _ in events)}
    return state


def exit_message(state: dict[str, Any], memory: str, tail: str) -> str:
    """Why a container ended (the engine's ``State``, empty when it did not answer).

    ``memory``: its limit, for the out-of-memory message; ``tail``: its last output lines.
    """
    code, oom = state.get("ExitCode"), bool(state.get("OOMKilled"))
    if state.get("Running") and not oom:
        message = ("The tool's sandbox closed its protocol connection during the call: a tool must not close "
                   "the shim's file descriptors. The sandbox was stopped.")
    elif oom:
        message = (
            f"The tool ran out of memory: its sandbox is limited to {memory} and was killed. "
            "Process less data at once, stream it, or write it to a file."
        )
    elif not state:
        message = ("The tool's sandbox stopped during the call, and the Docker engine did not say why "
                   "(it may be restarting); the sandbox is replaced once the engine answers again.")
    elif code == 0:
        message = ("The tool's sandbox exited during the call (exit code 0): a tool must return from execute(), "
                   "not call process.exit() or close the shim's file descriptors.")
    elif code == 137:
        message = "The tool's sandbox was killed (SIGKILL) during the call."
    else:
        message = f"The tool's sandbox exited with code {code} during the call."
    if tail and not oom:
        message += f" Its last output:\n{tail}"
    return message
