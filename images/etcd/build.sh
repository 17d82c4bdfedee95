#!/usr/bin/env bash
# Build sandboxd/etcd:<version>: Debian's etcd and etcdctl (packages etcd-server, etcd-client)
# with the C library they link and nothing else, for packaging/swarm/stack.yml's three members.
# No registry and no base image: a root filesystem of those files, `docker import`ed.
# Nothing is done when the image was built from the same binaries. Prints the tag last on stdout.
set -euo pipefail

HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
ETCD=${ETCD:-$(command -v etcd || true)}
ETCDCTL=${ETCDCTL:-$(command -v etcdctl || true)}

die() { echo "build-etcd: error: $*" >&2; exit 1; }
[ -x "$ETCD" ] && [ -x "$ETCDCTL" ] || die "etcd and etcdctl are not installed (apt-get install -y etcd-server etcd-client)"
docker info >/dev/null 2>&1 || die "the Docker engine is not reachable (docker info failed)"

version=$("$ETCD" --version | awk '/^etcd Version:/ { print $3 }')
TAG="sandboxd/etcd:$version"
inputs=$(cat "$ETCD" "$ETCDCTL" "$HERE/build.sh" | sha256sum | cut -c1-16)
built=$(docker image inspect -f '{{ index .Config.Labels "org.sandboxd.inputs" }}' "$TAG" 2>/dev/null || true)
if [ "$built" = "$inputs" ]; then echo "$TAG"; exit 0; fi

ROOT=$(mktemp -d "${TMPDIR:-/tmp}/sandboxd-etcd-image.XXXXXX")
trap 'rm -rf "$ROOT"' EXIT
mkdir -p "$ROOT/usr/bin" "$ROOT/etc" "$ROOT/tmp" "$ROOT/var/lib/etcd"
chmod 1777 "$ROOT/tmp"
install -m 0755 "$ETCD" "$ETCDCTL" "$ROOT/usr/bin/"
# The shared libraries ldd lists (the C library and its loader), at the same paths.
for lib in $(ldd "$ETCD" "$ETCDCTL" | awk '{ for (i = 1; i <= NF; i++) if ($i ~ /^\// && $i !~ /:$/) print $i }' | sort -u); do
  mkdir -p "$ROOT$(dirname "$lib")" && cp -L "$lib" "$ROOT$lib"
done
echo 'hosts: files dns' > "$ROOT/etc/nsswitch.conf"
tar --numeric-owner -C "$ROOT" -c . | docker import \
  --change 'ENV ETCDCTL_API=3' \
  --change "LABEL org.sandboxd.inputs=$inputs" \
  --change "LABEL org.opencontainers.image.title=etcd org.opencontainers.image.version=$version" \
  --change 'ENTRYPOINT ["/usr/bin/etcd"]' \
  - "$TAG" >/dev/null
echo "build-etcd: built $TAG ($(docker image inspect -f '{{.Size}}' "$TAG" | awk '{ printf "%.0f MB", $1 / 1e6 }'))" >&2
echo "$TAG"
