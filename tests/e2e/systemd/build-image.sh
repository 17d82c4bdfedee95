#!/usr/bin/env bash
# Build the image tests/e2e/test_systemd.py boots: systemd as PID 1 in a Debian bookworm
# minbase made with debootstrap (no registry), holding what docs/install.md asks of a host
# (a system Python 3.11 with venv, make) and what `make install` runs (systemd-analyze,
# systemd-sysusers, debootstrap for ensure-docker.sh). The Docker CLI and node come from the
# host at run time (bind mounts), as does the Docker engine.
# Tagged sandboxd/systemd-test:bookworm-<hash of this script>: a second run costs nothing.
#
# Usage: tests/e2e/systemd/build-image.sh [--print-tag]
# Environment: DEBIAN_MIRROR. Needs root, debootstrap and a running Docker engine.
set -euo pipefail

HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
REPO=$(cd "$HERE/../../.." && pwd)
TAG="sandboxd/systemd-test:bookworm-$(sha256sum < "${BASH_SOURCE[0]}" | cut -c1-12)"
PACKAGES="systemd,systemd-sysv,dbus,python3,python3-venv,make,debootstrap"
MIRROR=${DEBIAN_MIRROR:-http://deb.debian.org/debian}

log() { echo "systemd-image: $*" >&2; }
die() { echo "systemd-image: error: $*" >&2; exit 1; }

if [ "${1:-}" = --print-tag ]; then echo "$TAG"; exit 0; fi
if docker image inspect "$TAG" >/dev/null 2>&1; then echo "$TAG"; exit 0; fi

[ "$(id -u)" = 0 ] || die "must run as root (debootstrap needs it)"
command -v debootstrap >/dev/null || die "debootstrap is not installed (apt-get install -y debootstrap, or bash scripts/ensure-docker.sh)"

BUILD_DIR=$(mktemp -d "$REPO/build/systemd-image.XXXXXX")
trap 'rm -rf "$BUILD_DIR"' EXIT
start=$(date +%s)
log "debootstrap bookworm (minbase, $PACKAGES) from $MIRROR"
debootstrap --variant=minbase --include="$PACKAGES" bookworm "$BUILD_DIR/rootfs" "$MIRROR" \
  > "$BUILD_DIR/debootstrap.log" 2>&1 || { tail -n 30 "$BUILD_DIR/debootstrap.log" >&2; die "debootstrap failed"; }
ROOTFS=$BUILD_DIR/rootfs
# Units that want hardware, a network or a console the container does not have.
for unit in systemd-networkd.service systemd-resolved.service getty@tty1.service \
  systemd-timesyncd.service apt-daily.timer apt-daily-upgrade.timer e2scrub_all.timer fstrim.timer; do
  rm -f "$ROOTFS"/etc/systemd/system/*/"$unit"
done
: > "$ROOTFS/etc/resolv.conf"
: > "$ROOTFS/etc/hostname"
rm -rf "$ROOTFS"/var/cache/apt/archives/*.deb "$ROOTFS"/var/lib/apt/lists/* "$ROOTFS"/usr/share/doc/* "$ROOTFS"/usr/share/man/*
log "importing as $TAG"
tar --numeric-owner -C "$ROOTFS" -c . | docker import \
  --change 'ENV container=docker' --change 'CMD ["/sbin/init"]' \
  - "$TAG" >/dev/null
log "built $TAG in $(( $(date +%s) - start ))s"
echo "$TAG"
