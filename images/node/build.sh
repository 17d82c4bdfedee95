#!/usr/bin/env bash
# Build the runner image sandboxd/node:$(cat VERSION) (what `make image` runs).
#   1. the base image: SANDBOXD_BASE_IMAGE if set; else the official
#      node:20-bookworm-slim when present locally (never pulled: `docker pull` it
#      first to use it); else the registry-free sandboxd/node-base:bookworm-node20-<hash>
#      (`build-base.sh --print-tag`), built by build-base.sh when missing. Said on stderr and in the image's
#      label org.sandboxd.base;
#   2. the shim's node_modules: `npm ci` from the committed lock file, skipped when
#      the lock file has not changed since the last install;
#   3. docker build (layer cache: fast when nothing changed).
# Prints the image tag on the last line of stdout.
set -euo pipefail

HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
VERSION=$(tr -d ' \n' < "$HERE/VERSION")
TAG="sandboxd/node:$VERSION"
OFFICIAL_BASE=node:20-bookworm-slim
SHIM="$HERE/shim"

log() { echo "build: $*" >&2; }
die() { echo "build: error: $*" >&2; exit 1; }

docker info >/dev/null 2>&1 || die "the Docker engine is not reachable (docker info failed)"
start=$(date +%s)

# 1. base image. No pull: where no registry answers, a pull can hang for a minute on
# DNS and TCP timeouts, and whoever has a registry can pull the image once themselves.
if [ -n "${SANDBOXD_BASE_IMAGE:-}" ]; then
  BASE=$SANDBOXD_BASE_IMAGE why="SANDBOXD_BASE_IMAGE"
elif docker image inspect "$OFFICIAL_BASE" >/dev/null 2>&1; then
  BASE=$OFFICIAL_BASE why="the official image, present locally"
else
  BASE=$(bash "$HERE/build-base.sh" --print-tag)  # its tag names its package list
  why="registry-free, debootstrap; no $OFFICIAL_BASE locally (docker pull it to build FROM it)"
fi
log "base image $BASE ($why)"
if ! docker image inspect "$BASE" >/dev/null 2>&1; then
  case "$BASE" in
    sandboxd/node-base:*) bash "$HERE/build-base.sh" --tag "$BASE" >/dev/null ;;
    *) die "base image $BASE is not present locally and no registry is reachable here; build it or unset SANDBOXD_BASE_IMAGE" ;;
  esac
fi

# 2. shim dependencies (esbuild and its native binary, from the npm registry)
stamp="$SHIM/node_modules/.sandboxd-lock-sha256"
want=$(cat "$SHIM/package.json" "$SHIM/package-lock.json" | sha256sum | cut -d' ' -f1)
esbuild_ok() { (cd "$SHIM" && node -e 'require("esbuild").transformSync("let x: number = 1", { loader: "ts" })') >/dev/null 2>&1; }
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ] || ! esbuild_ok; then
  log "npm ci in $SHIM"
  # --ignore-scripts: esbuild's postinstall only re-checks the binary that the
  # optional dependency @esbuild/<platform> already installed; checked below.
  (cd "$SHIM" && npm ci --omit=dev --ignore-scripts --no-audit --no-fund --loglevel=error) >&2
  esbuild_ok || die "esbuild does not run after npm ci (is @esbuild/$(node -p 'process.platform + "-" + process.arch') in package-lock.json?)"
  echo "$want" > "$stamp"
fi

# 3. the image. Without the buildx plugin the CLI needs the legacy builder.
if ! docker buildx version >/dev/null 2>&1; then export DOCKER_BUILDKIT=0; fi
log "docker build $TAG (base $BASE)"
docker build \
  --build-arg "BASE=$BASE" \
  --build-arg "VERSION=$VERSION" \
  --label "org.sandboxd.base=$BASE" \
  -t "$TAG" "$HERE" >&2

size=$(docker image inspect -f '{{.Size}}' "$TAG" | awk '{printf "%.0f MB", $1/1e6}')
log "built $TAG ($size) in $(( $(date +%s) - start ))s"
echo "$TAG"
