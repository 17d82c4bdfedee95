#!/usr/bin/env bash
# Tools some tests need besides Docker, installed from Debian's packages when missing (as root):
# systemd-analyze (tests/unit/test_packaging.py verifies packaging/systemd/* with it; the
# `systemd` package is not started, only its analyzer is used) and ip (tests/e2e/test_systemd.py
# gives its site an address in its container's network namespace), and promtool (tests/unit/test_alerts.py
# checks and unit-tests packaging/prometheus/ with it; Debian ships it only in `prometheus`, never started here).
set -euo pipefail

missing=()
command -v systemd-analyze >/dev/null 2>&1 || missing+=(systemd)
command -v ip >/dev/null 2>&1 || missing+=(iproute2)
# mkfs.btrfs and btrfs: the disk quota's tests make btrfs filesystems on loop devices (test_disk_quota.py).
command -v mkfs.btrfs >/dev/null 2>&1 || missing+=(btrfs-progs)
command -v promtool >/dev/null 2>&1 || missing+=(prometheus)
# etcd and etcdctl: the cluster's e2e tests start their own etcd on 127.0.0.1 (tests/cluster/).
command -v etcd >/dev/null 2>&1 || missing+=(etcd-server)
command -v etcdctl >/dev/null 2>&1 || missing+=(etcd-client)
# openssl: tests/cluster/certs.py makes the cluster's test CA and certificates with the commands docs/install.md gives.
command -v openssl >/dev/null 2>&1 || missing+=(openssl)
if [ ${#missing[@]} -eq 0 ]; then
  exit 0
fi
if [ "$(id -u)" -ne 0 ]; then
  echo "ci-deps: ${missing[*]} missing; install them as root (apt-get install ${missing[*]})" >&2
  exit 1
fi
export DEBIAN_FRONTEND=noninteractive
apt-get update -qq
apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
# Only promtool is wanted: a prometheus server the package started under systemd is stopped and disabled.
if [[ " ${missing[*]} " == *" prometheus "* ]] && [ -d /run/systemd/system ]; then
  systemctl disable --now prometheus.service >/dev/null 2>&1 || true
fi
# The same for etcd: the tests start their own on free ports; a system one would hold 2379.
if [[ " ${missing[*]} " == *" etcd-server "* ]]; then
  if [ -d /run/systemd/system ]; then systemctl disable --now etcd.service >/dev/null 2>&1 || true; fi
  pkill -x etcd >/dev/null 2>&1 || true
fi
command -v systemd-analyze >/dev/null && command -v ip >/dev/null && command -v mkfs.btrfs >/dev/null && command -v promtool >/dev/null && command -v etcd >/dev/null && command -v etcdctl >/dev/null && command -v openssl >/dev/null
