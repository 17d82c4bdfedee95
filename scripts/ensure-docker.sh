#!/usr/bin/env bash
# Make sure a Docker engine answers: install Debian's engine and debootstrap when missing
# (as root), start dockerd when it is not running, and wait until `docker info` succeeds.
# A daemon that is already running is used as it is and never stopped.
set -euo pipefail

need_root() {
  if [ "$(id -u)" -ne 0 ]; then
    echo "ensure-docker: $1 needs root; run it yourself (e.g. sudo apt-get install docker.io && sudo systemctl start docker)" >&2
    exit 1
  fi
}

engine_up=0
docker info >/dev/null 2>&1 && engine_up=1

missing=()
[ "$engine_up" = 1 ] || command -v dockerd >/dev/null 2>&1 || missing+=(docker.io)
# The registry-free base (images/node/build-base.sh) needs debootstrap, whether or not
# Docker already runs (most newcomers already run it). Without root, say so and go on:
# an existing base image, or an official node:24-bookworm-slim (the lock file's major), needs no debootstrap.
if ! command -v debootstrap >/dev/null 2>&1; then
  if [ "$(id -u)" -eq 0 ]; then
    missing+=(debootstrap)
  else
    echo "ensure-docker: debootstrap is missing; building the registry-free base image needs it (sudo apt-get install debootstrap), an official node:24-bookworm-slim image present locally does not" >&2
  fi
fi
if [ ${#missing[@]} -gt 0 ]; then
  need_root "installing ${missing[*]}"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq "${missing[@]}" >/dev/null
fi

if [ "$engine_up" = 1 ]; then
  exit 0  # a running engine is used as it is
fi

if ! docker info >/dev/null 2>&1; then
  if command -v systemctl >/dev/null 2>&1 && systemctl is-system-running >/dev/null 2>&1; then
    need_root "starting docker"
    systemctl start docker
  else
    need_root "starting dockerd"
    mkdir -p /var/log
    nohup dockerd >/var/log/sandboxd-dockerd.log 2>&1 &
  fi
  for _ in $(seq 60); do
    docker info >/dev/null 2>&1 && break
    sleep 1
  done
fi

if ! docker info >/dev/null 2>&1; then
  echo "ensure-docker: dockerd did not come up; see /var/log/sandboxd-dockerd.log" >&2
  exit 1
fi
