"""The one way to make a backend and a user's ``SandboxSpec``: the daemon and ``sandboxd run`` alike."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Callable, Literal

from sandboxd.config import Config, email_db_path, shim_line_bytes
from sandboxd.egress.contract import Egress
from sandboxd.sandbox.backend import Backend, SandboxSpec
from sandboxd.sandbox.email_access import FULL_ACCESS
from sandboxd.tools.permissions import EmailAccess
from sandboxd.users import global_tools_dir, user_dir, user_tools_dir

BackendName = Literal["docker", "process", "fake"]


def make_backend(config: Config, name: BackendName, *, instance: str, shim_dir: Path | None = None) -> Backend:
    """``instance`` labels its containers (its orphans are found by it); ``shim_dir``: where the
    Docker backend keeps the sandboxes' socket directories (None: a private temporary one)."""
    max_line = shim_line_bytes(config.calls)
    if name == "docker":
        from sandboxd.sandbox.docker import DockerBackend

        # Not root: a gVisor sandbox's Sentry is another user's, killed by the privileged helper (sentry.py).
        helper = None if os.geteuid() == 0 else config.storage.helper_socket
        return DockerBackend(config.sandbox, instance=instance, max_line_bytes=max_line, shim_dir=shim_dir, helper=helper)
    if name == "process":
        from sandboxd.sandbox.process_backend import ProcessBackend

        return ProcessBackend(max_line_bytes=max_line)
    from sandboxd.sandbox.fake import FakeBackend

    return FakeBackend()


def user_sandbox_spec(config: Config, user: str, *, egress: Egress | None = None,
                      transpile_cache: Path | None = None,
                      provision: Callable[[str], None] | None = None,
                      email_access: EmailAccess = FULL_ACCESS) -> SandboxSpec:
    """What a sandbox of ``user`` mounts: the global tools, the user's folder, tools and, with ``email_access``,
    the email database."""
    data = config.data_path
    return SandboxSpec(
        user=user,
        tools_dir=global_tools_dir(data),
        user_dir=user_dir(data, user),
        user_tools_dir=user_tools_dir(data, user),
        email_db=email_db_path(config, user),
        root=data,
        egress=egress,
        transpile_cache=transpile_cache,
        provision=provision,
        email_access=email_access,
    )
