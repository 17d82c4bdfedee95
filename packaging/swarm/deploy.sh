#!/usr/bin/env bash
# Deploy sandboxd on a Docker Swarm (docs/scale.md, "On Docker Swarm"), as a manager (DOCKER_HOST).
#   packaging/swarm/deploy.sh [--load ENGINE]... [--router HOST]... [--stack NAME] HOST...
# HOST: a node's hostname that runs a sandboxd (labelled sandboxd=true); the first three also
# run the three etcd members. --router HOST: a host the router may run on (labelled
# sandboxd-router=true; name two, so that an update starts the new one before the old stops).
# What `docker stack deploy` cannot do, done first:
#   --load ENGINE  docker save the images from this machine's engine (where `make swarm-images`
#                  built them, not DOCKER_HOST's) and load them into ENGINE (a DOCKER_HOST URL,
#                  e.g. ssh://root@host2), for hosts that reach no registry; repeat per host;
#   the node labels; the CA and the certificates in SANDBOXD_PKI (default ./sandboxd-pki),
#   made with openssl when absent (node:HOST for each host, router:sandboxd, operator:NAME for you).
# Then `docker stack deploy`, which makes the Swarm configs and secrets, named by their content.
# Run again to change the config, a certificate or the image (SANDBOXD_IMAGE): Swarm updates one host at a time.
set -euo pipefail

HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
VERSION=$(tr -d ' \n' < "$HERE/../../images/node/VERSION")
export SANDBOXD_IMAGE=${SANDBOXD_IMAGE:-sandboxd/sandboxd:$VERSION}
export SANDBOXD_ETCD_IMAGE=${SANDBOXD_ETCD_IMAGE:-sandboxd/etcd:3.4.23}
RUNNER_IMAGE=${SANDBOXD_RUNNER_IMAGE:-sandboxd/node:$VERSION}
export SANDBOXD_PKI=${SANDBOXD_PKI:-$PWD/sandboxd-pki}
export SANDBOXD_CONFIG_FILE=${SANDBOXD_CONFIG_FILE:-$HERE/config.yaml}
export SANDBOXD_ROUTER_CONFIG_FILE=${SANDBOXD_ROUTER_CONFIG_FILE:-$HERE/router.yaml}
STACK=sandboxd
ENGINES=()
ROUTERS=()
HOSTS=()

die() { echo "deploy.sh: error: $*" >&2; exit 1; }
log() { echo "deploy.sh: $*" >&2; }
while [ $# -gt 0 ]; do
  case "$1" in
    --load) ENGINES+=("$2"); shift ;;
    --router) ROUTERS+=("$2"); shift ;;
    --stack) STACK=$2; shift ;;
    -h|--help) sed -n '2,16p' "$0"; exit 0 ;;
    -*) die "unknown option $1 (see --help)" ;;
    *) HOSTS+=("$1") ;;
  esac
  shift
done
[ ${#HOSTS[@]} -ge 3 ] || die "name at least three hosts (docker node ls): etcd runs a member on each of the first three"
WORK=$(mktemp -d "${TMPDIR:-/tmp}/sandboxd-deploy.XXXXXX")
trap 'rm -rf "$WORK"' EXIT
docker node ls >/dev/null 2>&1 || die "DOCKER_HOST is not a Swarm manager (docker node ls failed): run it on a manager, or docker swarm init"

# 1. Images, for hosts that pull from no registry: saved once, loaded on every engine at once.
if [ ${#ENGINES[@]} -gt 0 ]; then
  archive=$WORK/images.tar
  env -u DOCKER_HOST docker save -o "$archive" "$SANDBOXD_IMAGE" "$SANDBOXD_ETCD_IMAGE" "$RUNNER_IMAGE"
  pids=()
  for engine in "${ENGINES[@]}"; do docker -H "$engine" load -q -i "$archive" >/dev/null & pids+=($!); done
  for i in "${!pids[@]}"; do wait "${pids[$i]}" || die "docker load on ${ENGINES[$i]} failed"; done
  log "loaded $SANDBOXD_IMAGE, $SANDBOXD_ETCD_IMAGE and $RUNNER_IMAGE on ${#ENGINES[@]} engines"
fi

# 2. Which hosts run what.
for host in "${HOSTS[@]}"; do docker node update --label-add sandboxd=true "$host" >/dev/null; done
for host in "${ROUTERS[@]}"; do docker node update --label-add sandboxd-router=true "$host" >/dev/null; done
export SANDBOXD_ETCD_HOST1=${HOSTS[0]} SANDBOXD_ETCD_HOST2=${HOSTS[1]} SANDBOXD_ETCD_HOST3=${HOSTS[2]}

# 3. The CA and certificates (docs/install.md, "Certificates"), made once; keep ca.key offline after.
issue() {  # issue NAME COMMON_NAME
  [ -s "$SANDBOXD_PKI/$1.pem" ] && return 0
  printf 'basicConstraints=CA:FALSE\nkeyUsage=critical,digitalSignature\nextendedKeyUsage=serverAuth,clientAuth\n' > "$SANDBOXD_PKI/leaf.cnf"
  openssl req -new -newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes -keyout "$SANDBOXD_PKI/$1.key" \
    -out "$SANDBOXD_PKI/$1.csr" -subj "/CN=$2" 2>/dev/null
  openssl x509 -req -in "$SANDBOXD_PKI/$1.csr" -CA "$SANDBOXD_PKI/ca.pem" -CAkey "$SANDBOXD_PKI/ca.key" \
    -CAcreateserial -days 825 -out "$SANDBOXD_PKI/$1.pem" -extfile "$SANDBOXD_PKI/leaf.cnf" 2>/dev/null
  rm -f "$SANDBOXD_PKI/$1.csr"
  log "made $SANDBOXD_PKI/$1.pem ($2)"
}
mkdir -p -m 0700 "$SANDBOXD_PKI"
if [ ! -s "$SANDBOXD_PKI/ca.pem" ]; then
  openssl req -x509 -newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes -keyout "$SANDBOXD_PKI/ca.key" \
    -out "$SANDBOXD_PKI/ca.pem" -days 3650 -subj "/CN=sandboxd cluster CA" \
    -addext basicConstraints=critical,CA:TRUE -addext keyUsage=critical,keyCertSign,cRLSign 2>/dev/null
  log "made the CA in $SANDBOXD_PKI (ca.key signs every certificate: keep it offline)"
fi
for host in "${HOSTS[@]}"; do issue "node-$host" "node:$host"; done
issue router router:sandboxd
issue operator "operator:${SUDO_USER:-${USER:-root}}"
# The operator's config, for `sandboxd nodes drain` and the like run in a container on the stack's
# network with this folder at /pki (docs/install.md, "Drain a host").
[ -s "$SANDBOXD_PKI/operator.yaml" ] || printf '%s\n' "cluster:" \
  "  etcd: ['http://etcd1:2379', 'http://etcd2:2379', 'http://etcd3:2379']" \
  "  tls: {cert: /pki/operator.pem, key: /pki/operator.key, ca: /pki/ca.pem}" > "$SANDBOXD_PKI/operator.yaml"

# 4. Swarm configs and secrets cannot change: each is named by its content's hash.
version() { sha256sum "$1" | cut -c1-12; }
export SANDBOXD_CONFIG_VERSION=$(version "$SANDBOXD_CONFIG_FILE")
export SANDBOXD_CA_VERSION=$(version "$SANDBOXD_PKI/ca.pem")
export SANDBOXD_ROUTER_CONFIG_VERSION=$(version "$SANDBOXD_ROUTER_CONFIG_FILE")
export SANDBOXD_ROUTER_CERT_VERSION=$(version "$SANDBOXD_PKI/router.pem")
export SANDBOXD_ROUTER_KEY_VERSION=$(version "$SANDBOXD_PKI/router.key")

# Each host's certificate, a secret of the sandboxd service each (Swarm gives a service's secrets to
# all its tasks; a task uses its host's, by name). stack.yml cannot list the hosts: this file does.
hosts_file=$WORK/hosts.yml
{
  printf 'version: "3.8"\nservices:\n  sandboxd:\n    secrets:\n'
  for host in "${HOSTS[@]}"; do
    printf '      - {source: node-%s.pem}\n      - {source: node-%s.key, mode: 0400}\n' "$host" "$host"
  done
  printf 'secrets:\n'
  for host in "${HOSTS[@]}"; do
    for kind in pem key; do
      printf '  node-%s.%s: {name: sandboxd-node-%s-%s-%s, file: %s}\n' "$host" "$kind" "$host" "$kind" \
        "$(version "$SANDBOXD_PKI/node-$host.$kind")" "$SANDBOXD_PKI/node-$host.$kind"
    done
  done
} > "$hosts_file"
docker stack deploy --resolve-image never --prune -c "$HERE/stack.yml" -c "$hosts_file" "$STACK"
