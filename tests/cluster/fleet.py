"""A router in front of two hosts, as one process the clients' tests start instead of one daemon.

    python -m tests.cluster.fleet --config FILE --tools DIR --user alice@example.com

Starts a test etcd, certificates, hosts ``a`` and ``b`` (each with FILE's settings, a cluster
section and DIR's tools) and a router; prints one JSON line (the router's socket, each host's
data path, socket, config and instance label); then SIGHUP restarts the router, SIGUSR1 kills
it (SIGKILL, as a crash), SIGTERM stops everything. Each ``--user`` is placed on host ``a``
beforehand, so a test can put files in their folder before its first call.
clients/testing/daemon.mjs uses it when CLIENTS_VIA_ROUTER=1 (`make test-clients-router`).
"""

from __future__ import annotations

import argparse
import json
import shutil
import signal
import sys
import tempfile
import threading
from pathlib import Path

from tests.cluster.certs import make_certs
from tests.cluster.etcd import Etcd
from tests.cluster.router import Router, start_host


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tests.cluster.fleet", description=__doc__.split("\n\n")[0])
    p.add_argument("--config", type=Path, required=True, help="the hosts' settings (YAML, without cluster:)")
    p.add_argument("--tools", type=Path, help="global tools copied into each host's data path")
    p.add_argument("--user", action="append", default=[], help="a user placed on host a before the start")
    args = p.parse_args(argv)
    tmp = Path(tempfile.mkdtemp(prefix="fleet-"))
    etcd = Etcd().start()
    certs = make_certs(tmp / "certs")
    hosts = {}
    router = Router(tmp, etcd.url, certs.router)
    try:
        settings = args.config.read_text()
        for name, cert in (("a", certs.node_a), ("b", certs.node_b)):
            hosts[name] = start_host(tmp, name, etcd.url, cert, base=settings, tools=args.tools)
        for user in args.user:
            etcd.ctl("put", f"/sandboxd/users/{user}", json.dumps({"node": "a", "state": "active"}))
        router.start()
        print(json.dumps({"socket": str(router.socket), "router_log": str(router.log_path), "hosts": {
            name: {"data": str(host.data), "socket": str(host.socket), "config": str(host.config_path),
                   "instance": host.instance_label(), "log": str(host.log_path)} for name, host in hosts.items()}}),
              flush=True)
        _serve_signals(router)
    finally:
        router.stop()
        for host in hosts.values():
            host.stop()
        etcd.stop()
        shutil.rmtree(tmp, ignore_errors=True)
    return 0


def _serve_signals(router: Router) -> None:
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGHUP, lambda *_: _restart(router))
    signal.signal(signal.SIGUSR1, lambda *_: router.proc.kill() if router.proc is not None else None)
    while not stop.wait(0.5):
        pass


def _restart(router: Router) -> None:
    """Stop the router (or find it killed), start it again, and say so on stdout: the caller waits for that line."""
    router.stop()
    router.start()
    print(json.dumps({"router_restarted": router.proc.pid if router.proc is not None else None}), flush=True)


if __name__ == "__main__":
    sys.exit(main())
