"""A newcomer's first hour in a fresh clone (issue 29): `make serve` in one shell, the CLI in
another, and both read the same data — the checkout's `.sandboxd/data`.

The clone is the working tree's tracked files copied into a temporary folder; its `.venv` is
this checkout's (a link: no second install), and PYTHONPATH makes that venv import the
clone's `sandboxd`, so the clone's own defaults are what is tested. `make serve` runs with
`-o image` (the runner image is built once per machine, never by this test) and `SOCKET=`
(the README's way to pick a socket), and the CLI finds it through `SANDBOXD_SOCKET`.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Iterator

import pytest

from sandboxd.client import Client

from tests.e2e.conftest import REPO

pytestmark = pytest.mark.docker

USER = "newcomer@example.com"


def copy_tracked_files(destination: Path) -> None:
    """A fresh clone of the working tree: what git tracks, as it is on disk now (links kept as links)."""
    listed = subprocess.run(["git", "ls-files", "-z"], cwd=REPO, capture_output=True, check=True).stdout
    for name in filter(None, listed.decode().split("\0")):
        source, target = REPO / name, destination / name
        if not os.path.lexists(source):
            continue  # deleted in the working tree, not yet committed
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(source, target, follow_symlinks=False)


class Clone:
    def __init__(self, root: Path, socket_path: Path, config: Path) -> None:
        self.root = root
        self.socket = socket_path
        guard = str(REPO / "tests" / "netguard")  # the daemon may connect to loopback only
        inherited = {k: v for k, v in os.environ.items() if not k.startswith("SANDBOXD_")}
        # SANDBOXD_CONFIG: an empty file, so a machine's /etc/sandboxd/config.yaml cannot change the defaults tested.
        self.env = {**inherited, "PYTHONPATH": f"{guard}{os.pathsep}{root}", "SANDBOXD_CONFIG": str(config)}
        self.serve: subprocess.Popen[bytes] | None = None
        self.log = root / "make-serve.log"

    def start_make_serve(self) -> None:
        with open(self.log, "wb") as log:
            self.serve = subprocess.Popen(
                ["make", "-o", "image", "-o", ".venv/bin/sandboxd", "serve", f"SOCKET={self.socket}"],
                cwd=self.root, env=self.env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if self.serve.poll() is not None:
                raise AssertionError(f"make serve exited with {self.serve.returncode}:\n{self.log.read_text()}")
            try:
                with Client(self.socket, timeout=5) as client:
                    client.request("ping")
                return
            except Exception:
                time.sleep(0.2)
        raise AssertionError(f"make serve did not listen within 60 s:\n{self.log.read_text()}")

    def stop(self) -> None:
        if self.serve is not None and self.serve.poll() is None:
            os.killpg(self.serve.pid, signal.SIGTERM)  # make and the daemon it started: their own group
            try:
                self.serve.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(self.serve.pid, signal.SIGKILL)
                self.serve.wait()

    def events(self, name: str) -> list[dict[str, Any]]:
        found = []
        for line in self.log.read_text(errors="replace").splitlines():
            try:
                record = json.loads(line)
            except ValueError:
                continue
            if isinstance(record, dict) and record.get("event") == name:
                found.append(record)
        return found

    def sandboxd(self, *args: str, cwd: Path | None = None, timeout: float = 120) -> subprocess.CompletedProcess[str]:
        """The second shell: `. .venv/bin/activate; export SANDBOXD_SOCKET=...; sandboxd ...`."""
        return subprocess.run([str(self.root / ".venv" / "bin" / "sandboxd"), *args], cwd=cwd or self.root,
                              env={**self.env, "SANDBOXD_SOCKET": str(self.socket)},
                              capture_output=True, text=True, timeout=timeout)


@pytest.fixture
def clone(tmp_path: Path, docker_api: Any) -> Iterator[Clone]:
    root = tmp_path / "sandboxd"
    copy_tracked_files(root)
    (root / ".venv").symlink_to(REPO / ".venv")
    config = tmp_path / "empty.yaml"
    config.write_text("")
    # Socket paths are limited to 108 bytes; pytest's tmp paths can be longer.
    made = Clone(root, Path(tempfile.mkdtemp(prefix="sbd-clone-")) / "sandboxd.sock", config)
    try:
        yield made
    finally:
        made.stop()
        from sandboxd.config import load_config
        from sandboxd.server.server import instance_id

        label = instance_id(load_config(overrides={"data_path": root / ".sandboxd" / "data"}, environ={}))
        left = docker_api.api.containers(all=True, filters={"label": f"org.sandboxd.instance={label}"})
        for container in left:
            docker_api.api.remove_container(container["Id"], force=True)
        assert not left, f"make serve's daemon left {len(left)} containers:\n{made.log.read_text()[-4000:]}"


def test_make_serve_and_every_command_of_a_second_shell_read_the_same_data(clone: Clone, tmp_path: Path) -> None:
    data = clone.root / ".sandboxd" / "data"
    clone.start_make_serve()
    [listening] = clone.events("listening")
    assert listening["data_path"] == str(data) and listening["socket"] == str(clone.socket), listening

    # tools list --disk reads the daemon's data, and says so.
    listed = clone.sandboxd("tools", "list", "--disk")
    assert listed.returncode == 0, listed.stderr
    assert f"reading the tools from the disk in {data}" in listed.stderr
    assert re.search(r"^hello\s+1\s+global\s", listed.stdout, re.M), listed.stdout

    # A new tool, run from its folder: the "next:" hint names the folder the daemon reads.
    work = tmp_path / "work"
    work.mkdir()
    assert clone.sandboxd("new", "mytool", cwd=work).returncode == 0
    ran = clone.sandboxd("run", "mytool", cwd=work)
    assert ran.returncode == 0, ran.stderr
    hint = re.search(r"install it for a user by copying mytool to (\S+)/<user>/tools/", ran.stderr)
    assert hint, ran.stderr
    assert Path(hint.group(1)) == data, f"the hint names {hint.group(1)}, the daemon reads {data}"
    shutil.copytree(work / "mytool", data / USER / "tools" / "mytool")
    served = clone.sandboxd("tools", "list", "--user", USER)
    assert f"tools as the daemon at {clone.socket} serves them" in served.stderr, served.stderr
    assert re.search(r"^mytool\s+1\s+user\s", served.stdout, re.M), served.stdout
    called = clone.sandboxd("call", "--user", USER, "mytool", "--arg", "city=Oslo")
    assert called.returncode == 0 and 'received city "Oslo"' in called.stdout, called

    # An edit of a seed tool without a version bump: validate compares with the daemon's synced copy.
    entry = clone.root / "seed" / "tools" / "hello" / "index.ts"
    entry.write_text(entry.read_text() + "\n// an edit\n")
    checked = clone.sandboxd("validate", "seed/tools/hello")
    assert checked.returncode == 1, checked
    assert f"version bumps checked against the synced tools in {data / 'tools'}" in checked.stderr
    assert "bump the version: 'version: 2'" in checked.stdout and checked.stdout.endswith("1 error, 0 warnings\n")
