"""The esbuild binary the sandboxes' shim uses, run on the host to fill the transpile cache.

A backend hands one out (``Backend.esbuild``: Docker copies it out of the runner image);
tools/transpile_cache.py runs it. Its own module so the backend interface can name it
without importing the cache, which imports the interface for the sandbox's paths.
"""

from __future__ import annotations

import json
import os
import subprocess
from dataclasses import dataclass
from pathlib import Path

from sandboxd.logging import get_logger

log = get_logger("sandboxd.tools")
# The runner image's Node (images/node/runtime); the shim's loader.js transpiles for the same one.
NODE_TARGET = "node24"


@dataclass(frozen=True)
class Esbuild:
    binary: Path
    version: str

    def transpile(self, source: str, loader: str, filename: str) -> str | None:
        """What the shim's transformSync would make of ``source``; None if esbuild warned or failed
        (the shim then transpiles it itself, and says so in the call's log as before)."""
        url = "file://" + filename  # a plain path: pathToFileURL() encodes nothing in it
        args = [str(self.binary), f"--loader={loader}", "--format=cjs", "--platform=node", f"--target={NODE_TARGET}",
                "--sourcemap=inline", "--sources-content=false", f"--sourcefile={filename}",
                "--supported:dynamic-import=false", f"--define:import.meta.url={json.dumps(url)}",
                f"--define:import.meta.filename={json.dumps(filename)}",
                f"--define:import.meta.dirname={json.dumps(os.path.dirname(filename))}", "--log-level=warning"]
        try:
            done = subprocess.run(args, input=source.encode(), capture_output=True, timeout=30, check=False)
        except (OSError, subprocess.TimeoutExpired) as exc:
            log.warning("transpile_cache_esbuild_failed", file=filename, error=str(exc))
            return None
        if done.returncode != 0 or done.stderr:
            return None
        return done.stdout.decode()
