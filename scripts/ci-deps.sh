#!/usr/bin/env bash
# Tools some tests need besides Docker: systemd-analyze (tests/unit/test_packaging.py
# verifies packaging/systemd/* with it). Installs Debian's `systemd` package when missing,
# as root; it is not started, only its analyzer is used.
set -euo pipefail

if command -v systemd-analyze >/dev/null 2>&1; then
  exit 0
fi
if [ "$(id -u)" -ne 0 ]; then
  echo "ci-deps: systemd-analyze is missing; install it as root (apt-get install systemd)" >&2
  exit 1
fi
export DEBIAN_FRONTEND=noninteractive
apt-get update -qq
apt-get install -y -qq --no-install-recommends systemd >/dev/null
command -v systemd-analyze >/dev/null
