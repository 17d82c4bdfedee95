#!/usr/bin/env bash
# Build the registry-free base image for the Node runner (default tag
# sandboxd/node-base:bookworm-node20-<hash of PACKAGES>): a Debian bookworm minbase
# root filesystem made with debootstrap from the Debian mirror, plus this machine's
# Node binary. It stands in for the official node:20-bookworm-slim image where no
# container registry is reachable. Needs root, debootstrap and a running Docker engine.
#
# Usage: images/node/build-base.sh [--force] [--tag TAG] [--print-tag]
#   --force      rebuild even when TAG already exists
#   --print-tag  print the default tag and exit (build.sh uses it)
# Environment: SANDBOXD_BASE_IMAGE (default tag), DEBIAN_MIRROR, NODE_BIN.
set -euo pipefail

# What tools call (TOOLS.md): CA certificates, sqlite3, python3, which (debianutils;
# Essential, named so the intent is explicit), ffmpeg/ffprobe, tesseract with
# English data, poppler's pdftotext/pdftoppm. The Dockerfile installs the same on
# the official-image path. The default tag carries a hash of this list, so a
# machine holding a base built from an older list builds the new one.
PACKAGES="ca-certificates,sqlite3,python3,debianutils,ffmpeg,tesseract-ocr,tesseract-ocr-eng,poppler-utils"
# Mesa's GPU drivers (and the LLVM they need, ~160 MB of the ~480 MB ffmpeg brings):
# ffmpeg links libGL, which loads a driver only for an OpenGL context, which nothing
# headless in a sandbox makes. Removed with --force-depends; apt in a derived image
# then wants `apt-get -f install` first (it puts them back).
DROP="libgl1-mesa-dri libllvm15 libz3-4"
DEFAULT_TAG="sandboxd/node-base:bookworm-node20-$(printf '%s|%s' "$PACKAGES" "$DROP" | sha256sum | cut -c1-8)"

HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
REPO=$(cd "$HERE/../.." && pwd)
TAG=${SANDBOXD_BASE_IMAGE:-$DEFAULT_TAG}
MIRROR=${DEBIAN_MIRROR:-http://deb.debian.org/debian}
SUITE=bookworm
FORCE=0

while [ $# -gt 0 ]; do
  case "$1" in
    --force) FORCE=1 ;;
    --tag) TAG=$2; shift ;;
    --print-tag) echo "$DEFAULT_TAG"; exit 0 ;;
    -h|--help) sed -n '2,11p' "$0"; exit 0 ;;
    *) echo "build-base.sh: unknown argument: $1" >&2; exit 2 ;;
  esac
  shift
done

log() { echo "build-base: $*" >&2; }
die() { echo "build-base: error: $*" >&2; exit 1; }

if [ "$FORCE" = 0 ] && docker image inspect "$TAG" >/dev/null 2>&1; then
  have=$(docker image inspect -f '{{index .Config.Labels "org.sandboxd.node-version"}}' "$TAG" 2>/dev/null || true)
  log "$TAG already exists (node ${have:-?}); skipping (use --force to rebuild)"
  exit 0
fi

[ "$(id -u)" = 0 ] || die "must run as root (debootstrap and chroot need it)"
command -v debootstrap >/dev/null || die "debootstrap is not installed (apt-get install -y debootstrap)"
docker info >/dev/null 2>&1 || die "the Docker engine is not reachable (docker info failed)"

NODE_BIN=${NODE_BIN:-$(command -v node || true)}
[ -n "$NODE_BIN" ] && [ -x "$NODE_BIN" ] || die "no node binary found (set NODE_BIN)"
NODE_BIN=$(readlink -f "$NODE_BIN")
NODE_VERSION=$("$NODE_BIN" -p process.version)
NODE_MAJOR=$("$NODE_BIN" -p 'process.versions.node.split(".")[0]')
[ "$NODE_MAJOR" -ge 20 ] || die "host node is $NODE_VERSION; the runner needs Node >= 20"
ARCH=$(dpkg --print-architecture)

BUILD_DIR="$REPO/build/node-base"
ROOTFS="$BUILD_DIR/rootfs"
cleanup() { rm -rf "$BUILD_DIR"; }
trap cleanup EXIT
cleanup
mkdir -p "$BUILD_DIR"

start=$(date +%s)
log "debootstrap $SUITE ($ARCH, minbase) from $MIRROR into $ROOTFS"
debootstrap --variant=minbase --arch="$ARCH" \
  --include="$PACKAGES" \
  "$SUITE" "$ROOTFS" "$MIRROR" > "$BUILD_DIR/debootstrap.log" 2>&1 \
  || { tail -n 30 "$BUILD_DIR/debootstrap.log" >&2; die "debootstrap failed"; }

log "removing $DROP (GPU drivers)"
# shellcheck disable=SC2086 # a list of package names
chroot "$ROOTFS" dpkg --purge --force-depends $DROP >> "$BUILD_DIR/debootstrap.log" 2>&1 \
  || { tail -n 30 "$BUILD_DIR/debootstrap.log" >&2; die "dpkg --purge $DROP failed"; }

log "installing $NODE_BIN ($NODE_VERSION) as /usr/local/bin/node"
install -m 0755 "$NODE_BIN" "$ROOTFS/usr/local/bin/node"
# The distribution's binary carries debug info (~12 MB); drop it when we can.
if command -v strip >/dev/null; then strip --strip-debug "$ROOTFS/usr/local/bin/node"; fi

# Every shared library the host binary needs must resolve inside the rootfs.
missing=$(chroot "$ROOTFS" /usr/bin/ldd /usr/local/bin/node | grep 'not found' || true)
[ -z "$missing" ] || die "node's shared libraries are missing in the rootfs: $missing"
got=$(chroot "$ROOTFS" /usr/local/bin/node -p process.version)
[ "$got" = "$NODE_VERSION" ] || die "node in the rootfs reports '$got', expected $NODE_VERSION"
for cmd in sh which python3 sqlite3 ffmpeg ffprobe tesseract pdftotext pdftoppm; do
  chroot "$ROOTFS" /bin/sh -c "command -v $cmd" >/dev/null || die "$cmd is missing in the rootfs"
  # Nothing the binaries link went with $DROP.
  missing=$(chroot "$ROOTFS" /bin/sh -c "ldd \$(command -v $cmd)" 2>/dev/null | grep 'not found' || true)
  [ -z "$missing" ] || die "$cmd's shared libraries are missing in the rootfs: $missing"
done
chroot "$ROOTFS" ffmpeg -hide_banner -loglevel error -f lavfi -i sine=d=0.1 -f null - \
  || die "ffmpeg does not run in the rootfs"
[ -s "$ROOTFS/etc/ssl/certs/ca-certificates.crt" ] || die "CA certificates are missing in the rootfs"
chroot "$ROOTFS" tesseract --list-langs 2>&1 | grep -qx eng || die "tesseract's English data is missing in the rootfs"

# Trim what a runtime never needs: apt caches and lists, docs, man pages, locales.
rm -rf "$ROOTFS"/var/cache/apt/archives/*.deb "$ROOTFS"/var/cache/apt/*.bin \
  "$ROOTFS"/var/lib/apt/lists/* "$ROOTFS"/usr/share/doc/* "$ROOTFS"/usr/share/man/* \
  "$ROOTFS"/usr/share/info/* "$ROOTFS"/var/log/* "$ROOTFS"/tmp/* "$ROOTFS"/var/tmp/*
find "$ROOTFS/usr/share/locale" -mindepth 1 -maxdepth 1 ! -name 'locale.alias' -exec rm -rf {} + 2>/dev/null || true
# debootstrap copies the host's resolv.conf/hostname; Docker provides its own.
: > "$ROOTFS/etc/resolv.conf"
: > "$ROOTFS/etc/hostname"
# So that apt works in a derived image (the Dockerfile's fallback path).
echo "deb $MIRROR $SUITE main" > "$ROOTFS/etc/apt/sources.list"

log "importing as $TAG"
tar --numeric-owner -C "$ROOTFS" -c . | docker import \
  --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
  --change 'ENV LANG=C.UTF-8' \
  --change "LABEL org.sandboxd.node-version=$NODE_VERSION" \
  --change "LABEL org.sandboxd.base=debootstrap-$SUITE-minbase" \
  --change "LABEL org.sandboxd.base-packages=$PACKAGES" \
  --change "LABEL org.sandboxd.base-dropped=\"$DROP\"" \
  --change 'CMD ["/bin/sh"]' \
  - "$TAG" >/dev/null

log "built $TAG in $(( $(date +%s) - start ))s ($(docker image inspect -f '{{.Size}}' "$TAG" | awk '{printf "%.0f MB", $1/1e6}'))"
echo "$TAG"
