#!/usr/bin/env bash
# Build the daemon image sandboxd/sandboxd:$(cat images/node/VERSION) for packaging/swarm/.
#   - FROM the runner's registry-free base (images/node/build-base.sh, built when missing),
#     or SANDBOXD_BASE_IMAGE;
#   - the sandboxd package as committed (git HEAD), with its dependencies from pip, for
#     Python 3.11; SANDBOXD_IMAGE_TREE=worktree takes the work tree's files instead;
#   - nothing is done when the image was built from the same inputs (label org.sandboxd.inputs).
# Prints the image tag on the last line of stdout; progress on stderr.
set -euo pipefail

HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
REPO=$(cd "$HERE/../.." && pwd)
VERSION=$(tr -d ' \n' < "$REPO/images/node/VERSION")
TAG="sandboxd/sandboxd:$VERSION"
PIP=${PIP:-$REPO/.venv/bin/pip}
TREE=${SANDBOXD_IMAGE_TREE:-HEAD}
# What the image is made of, besides this folder: the package, its metadata, the seed tools
# and the lint fixes file the package links to.
SOURCES=(sandboxd pyproject.toml README.md seed/tools images/node/shim/src/fixes.json)

log() { echo "build-sandboxd: $*" >&2; }
die() { echo "build-sandboxd: error: $*" >&2; exit 1; }

docker info >/dev/null 2>&1 || die "the Docker engine is not reachable (docker info failed)"
[ -x "$PIP" ] || die "no pip at $PIP: run make setup (or set PIP=path/to/pip of a Python 3.11)"
start=$(date +%s)

BASE=${SANDBOXD_BASE_IMAGE:-$(bash "$REPO/images/node/build-base.sh" --print-tag)}
if ! docker image inspect "$BASE" >/dev/null 2>&1; then
  log "building the base image $BASE"
  bash "$REPO/images/node/build-base.sh" --tag "$BASE" >/dev/null
fi

sources_hash() {
  if [ "$TREE" = worktree ]; then
    (cd "$REPO" && find "${SOURCES[@]}" -type f -not -path '*/__pycache__/*' -print0 | LC_ALL=C sort -z | xargs -0 sha256sum)
  else
    (cd "$REPO" && for s in "${SOURCES[@]}"; do echo "$s $(git rev-parse "HEAD:$s")"; done)
  fi
}
inputs=$( {
  echo "base $BASE $(docker image inspect -f '{{.Id}}' "$BASE")"
  sources_hash
  (cd "$HERE" && sha256sum Dockerfile build.sh sandboxd.sh)
} | sha256sum | cut -c1-16)
built=$(docker image inspect -f '{{ index .Config.Labels "org.sandboxd.inputs" }}' "$TAG" 2>/dev/null || true)
if [ "$built" = "$inputs" ]; then
  echo "$TAG"
  exit 0
fi

CONTEXT=$(mktemp -d "${TMPDIR:-/tmp}/sandboxd-image.XXXXXX")
trap 'rm -rf "$CONTEXT"' EXIT
mkdir -p "$CONTEXT/src"
if [ "$TREE" = worktree ]; then
  (cd "$REPO" && tar -c --dereference --exclude=__pycache__ "${SOURCES[@]}") | tar -x -C "$CONTEXT/src"
else
  (cd "$REPO" && git archive HEAD "${SOURCES[@]}") | tar -x -C "$CONTEXT/src"
fi
log "pip install sandboxd ($TREE) and its dependencies into the build context"
"$PIP" install -q --disable-pip-version-check --target "$CONTEXT/site" --no-compile "$CONTEXT/src" 2>"$CONTEXT/pip.log" \
  || { cat "$CONTEXT/pip.log" >&2; die "pip install failed"; }
rm -rf "$CONTEXT/site/bin"  # console scripts naming the build host's interpreter
mv "$CONTEXT/src/seed/tools" "$CONTEXT/seed-tools"
cp "$HERE/Dockerfile" "$HERE/sandboxd.sh" "$CONTEXT/"

log "docker build $TAG (base $BASE)"
if ! docker buildx version >/dev/null 2>&1; then export DOCKER_BUILDKIT=0; fi
docker build -q --build-arg "BASE=$BASE" --build-arg "VERSION=$VERSION" \
  --label "org.sandboxd.inputs=$inputs" -t "$TAG" "$CONTEXT" >"$CONTEXT/build.log" 2>&1 \
  || { tail -n 40 "$CONTEXT/build.log" >&2; die "docker build $TAG failed"; }
size() { docker image inspect -f '{{.Size}}' "$1"; }
log "built $TAG in $(( $(date +%s) - start ))s ($(( ($(size "$TAG") - $(size "$BASE")) / 1000000 )) MB over the base it shares with the runner image)"
echo "$TAG"
