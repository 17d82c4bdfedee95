#!/usr/bin/env bash
# Build the runner image sandboxd/node:$(cat VERSION) (what `make image` runs).
#   1. the base image: SANDBOXD_BASE_IMAGE if set; else the official
#      node:<major>-bookworm-slim when present locally, <major> the one pinned in
#      runtime/package-lock.json (never pulled: `docker pull` it first to use it); else the
#      registry-free sandboxd/node-base:bookworm-node<version>-<hash> (`build-base.sh --print-tag`),
#      built by build-base.sh when missing. Said on stderr and in the image's labels
#      org.sandboxd.base and org.sandboxd.node;
#   2. the shim's node_modules: `npm ci` from the committed lock file, skipped when
#      the lock file has not changed since the last install;
#   3. docker build, only when the image's inputs changed since TAG was built (their hash is
#      the label org.sandboxd.inputs): nothing is printed when nothing changed; a line per
#      build step while it builds, and docker's own log only when the build fails.
# Prints the image tag on the last line of stdout.
set -euo pipefail

HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
VERSION=$(tr -d ' \n' < "$HERE/VERSION")
TAG="sandboxd/node:$VERSION"
NODE_LOCKED=$(bash "$HERE/node-runtime.sh" --version)  # 24.22.3
NODE_MAJOR=${NODE_LOCKED%%.*}
OFFICIAL_BASE=node:$NODE_MAJOR-bookworm-slim
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
if ! docker image inspect "$BASE" >/dev/null 2>&1; then
  log "building the base image $BASE ($why)"
  case "$BASE" in
    sandboxd/node-base:*) bash "$HERE/build-base.sh" --tag "$BASE" >/dev/null ;;
    *) die "base image $BASE is not present locally and no registry is reachable here; build it or unset SANDBOXD_BASE_IMAGE" ;;
  esac
fi

# 2. shim dependencies (esbuild and its native binary, from the npm registry)
stamp="$SHIM/node_modules/.sandboxd-lock-sha256"
want=$(cat "$SHIM/package.json" "$SHIM/package-lock.json" | sha256sum | cut -d' ' -f1)
esbuild_ok() { (cd "$SHIM" && node -e 'require("esbuild").transformSync("let x: number = 1", { loader: "ts" })') >/dev/null 2>&1; }
fresh() { [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ] && esbuild_ok; }
if ! fresh; then
  # One npm ci at a time in this checkout (make image runs in parallel test sessions).
  mkdir -p "$HERE/../../build" && exec 9>"$HERE/../../build/.shim-npm.lock" && flock 9
fi
if ! fresh; then
  log "npm ci in $SHIM"
  # --ignore-scripts: esbuild's postinstall only re-checks the binary that the
  # optional dependency @esbuild/<platform> already installed; checked below.
  (cd "$SHIM" && npm ci --omit=dev --ignore-scripts --no-audit --no-fund --loglevel=error) >&2
  esbuild_ok || die "esbuild does not run after npm ci (is @esbuild/$(node -p 'process.platform + "-" + process.arch') in package-lock.json?)"
  echo "$want" > "$stamp"
fi

# 3. the image, unless TAG was built from these very inputs: what the Dockerfile copies, the
# base image's id and the dependencies' lock (node_modules follows from it).
inputs=$( {
  echo "base $BASE $(docker image inspect -f '{{.Id}}' "$BASE" 2>/dev/null)"
  echo "dependencies $want"
  (cd "$HERE" && find Dockerfile .dockerignore VERSION shim/src -type f -print0 | LC_ALL=C sort -z | xargs -0 sha256sum)
} | sha256sum | cut -c1-16)
built=$(docker image inspect -f '{{ index .Config.Labels "org.sandboxd.inputs" }}' "$TAG" 2>/dev/null || true)
if [ "$built" = "$inputs" ]; then
  echo "$TAG"
  exit 0
fi
log "base image $BASE ($why)"
# The Node the image runs, for the log and the label: the base's own label when
# build-base.sh made it, else asked of the base itself (no network, removed at once).
node_version=$(docker image inspect -f '{{ index .Config.Labels "org.sandboxd.node-version" }}' "$BASE" 2>/dev/null || true)
case "$node_version" in
  v*) node_source=$(docker image inspect -f '{{ index .Config.Labels "org.sandboxd.node-source" }}' "$BASE" 2>/dev/null || true) ;;
  *) node_version=$(docker run --rm --network none --entrypoint node "$BASE" -p process.version 2>/dev/null || true)
     node_source="" ;;
esac
[ -n "$node_version" ] || die "cannot run node in the base image $BASE (docker run --rm --entrypoint node $BASE -v)"
log "node $node_version (${node_source:-from $BASE})"
if [ -n "$built" ]; then
  log "docker build $TAG: its inputs changed (the Dockerfile, the shim, its dependencies or the base)"
else
  log "docker build $TAG"
fi
# Without the buildx plugin the CLI needs the legacy builder. Its step log (and the
# builder's banners) go to a file, shown when the build fails; a line per step here.
if ! docker buildx version >/dev/null 2>&1; then export DOCKER_BUILDKIT=0; fi
build_log=$(mktemp "${TMPDIR:-/tmp}/sandboxd-image-build.XXXXXX")
steps() {
  local line step seen=" "
  while IFS= read -r line; do
    printf '%s\n' "$line" >> "$build_log"
    case "$line" in
      "Step "[0-9]*" : "*) step=${line#Step } ;;                           # the legacy builder
      "#"[0-9]*" ["*"] "*) step=${line#\#* } ;;                              # BuildKit, --progress=plain
      *) continue ;;
    esac
    case "$seen" in *" ${step%% *} "*) continue ;; esac  # BuildKit repeats a step's header
    seen="$seen${step%% *} "
    step=${step/ : / }
    log "step ${step:0:90} ($(( $(date +%s) - start ))s)"
  done
}
progress=(); [ "${DOCKER_BUILDKIT:-}" = 0 ] || progress=(--progress=plain)
if ! docker build "${progress[@]}" \
  --build-arg "BASE=$BASE" \
  --build-arg "VERSION=$VERSION" \
  --build-arg "NODE_MAJOR=$NODE_MAJOR" \
  --label "org.sandboxd.base=$BASE" \
  --label "org.sandboxd.node=$node_version" \
  --label "org.sandboxd.inputs=$inputs" \
  -t "$TAG" "$HERE" 2>&1 | steps; then
  tail -n 60 "$build_log" >&2
  die "docker build $TAG failed (the whole log: $build_log)"
fi
rm -f "$build_log"

size=$(docker image inspect -f '{{.Size}}' "$TAG" | awk '{printf "%.0f MB", $1/1e6}')
log "built $TAG ($size) in $(( $(date +%s) - start ))s"
echo "$TAG"
