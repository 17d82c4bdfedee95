"""Why a Docker sandbox ended, in words an agent can act on."""

from __future__ import annotations

from typing import Any


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
