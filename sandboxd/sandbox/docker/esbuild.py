"""The image's own esbuild, copied out of it for the transpile cache (tools/transpile_cache.py)."""

from __future__ import annotations

import io
import json
import os
import platform
import re
import tarfile
from pathlib import Path
from typing import Any

from sandboxd.sandbox.docker.spec import esbuild_source_spec
from sandboxd.tools.esbuild import Esbuild

# In the runner image (images/node/Dockerfile): the shim's esbuild, and its binary for this machine.
IMAGE_ESBUILD_PACKAGE = "/opt/sandboxd/shim/node_modules/esbuild/package.json"
IMAGE_ESBUILD_BINARY = "/opt/sandboxd/shim/node_modules/@esbuild/linux-{arch}/bin/esbuild"
_ARCHES = {"x86_64": "x64", "amd64": "x64", "aarch64": "arm64", "arm64": "arm64"}


def _archive_file(api: Any, container: str, path: str) -> bytes:
    """One regular file out of a (created, never started) container."""
    stream, _ = api.get_archive(container, path)
    with tarfile.open(fileobj=io.BytesIO(b"".join(stream))) as archive:
        member = archive.next()
        extracted = archive.extractfile(member) if member is not None and member.isfile() else None
        if extracted is None:
            raise OSError(f"{path} in the image is not a regular file")
        return extracted.read()


def extract_esbuild(api: Any, image: str, instance: str, directory: Path) -> Esbuild:
    """The image's own esbuild binary, copied to ``directory`` once per version (blocking)."""
    arch = _ARCHES.get(platform.machine().lower())
    if arch is None:
        raise OSError(f"no esbuild binary for this machine ({platform.machine()})")
    container = api.create_container(**esbuild_source_spec(image, instance))["Id"]
    try:
        version = json.loads(_archive_file(api, container, IMAGE_ESBUILD_PACKAGE))["version"]
        if not isinstance(version, str) or not re.fullmatch(r"[0-9A-Za-z.+-]+", version):
            raise OSError(f"the image's esbuild has an odd version: {version!r}")
        binary = directory / f"esbuild-{version}-{arch}"
        if not binary.exists():
            directory.mkdir(parents=True, exist_ok=True)
            temporary = directory / f".{binary.name}.{os.getpid()}"
            temporary.write_bytes(_archive_file(api, container, IMAGE_ESBUILD_BINARY.format(arch=arch)))
            temporary.chmod(0o755)
            os.replace(temporary, binary)
    finally:
        api.remove_container(container, force=True)
    return Esbuild(binary, version)
