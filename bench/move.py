"""What `sandboxd users move` costs (docs/performance.md): one user of ``mib`` MiB moved between two real hosts.

Two daemons with mutual-TLS listeners, each with its data path on a btrfs loop filesystem of its own under a
hard quota, a test etcd on 127.0.0.1, certificates made with openssl. The user (16 files of random bytes,
1,000 small files, an email database) is claimed by host a with one call, then moved to b by the operator's
command, timed from its start to its exit: the mark, the snapshot, the pull over TLS, the import with every
sha256 checked, the check and the flip.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable

from bench import daemon as d
from bench.load import daemon_call_line
from bench.transfer import make_files
from tests.loopfs import loop_devices_usable, loop_filesystem


def move_cost(root: Path, run_id: str, image: str, *, mib: int, say: Callable[[str], None]) -> dict[str, Any]:
    problem = loop_devices_usable("btrfs")
    if shutil.which("etcd") is None or shutil.which("openssl") is None:
        problem = "etcd or openssl is missing (scripts/ci-deps.sh installs them)"
    if problem is not None:
        return {"skipped": problem}
    from tests.cluster.certs import make_certs
    from tests.cluster.etcd import Etcd
    from tests.cluster.router import host_config

    user = f"move-{run_id}@bench.example"
    storage = f"sandbox:\n  image: {image}\nstorage:\n  enforcement: hard\n  quota_bytes: {mib * 2}m\n"
    etcd, certs = Etcd().start(), make_certs(root / "certs")
    hosts: dict[str, d.BenchDaemon] = {}
    try:
        with loop_filesystem(root / "a" / "data", "btrfs", mib * 2 + 768), \
                loop_filesystem(root / "b" / "data", "btrfs", mib * 2 + 768):
            try:
                for name, cert in (("a", certs.node_a), ("b", certs.node_b)):
                    hosts[name] = d.BenchDaemon(root / name, host_config(name, etcd.url, cert, extra=storage)[0],
                                                fresh_tools=0)
                    hosts[name].start()
                conn = hosts["a"].connect()
                d._check_ok(d._call(conn, daemon_call_line(user), 1)[1], "the user's first call on host a")
                conn.close()
                say(f"users move: writing a {mib}-MiB user on host a")
                files = make_files(hosts["a"].data, user, mib)
                os.sync()
                operator = root / "operator.yaml"
                operator.write_text(f"cluster:\n  etcd: ['{etcd.url}']\n" + certs.operator.tls_yaml())
                say("users move: host a to host b")
                return {"mib": mib, "files": files, **_timed_move(user, operator)}
            finally:  # before their filesystems are taken down
                for host in hosts.values():
                    host.stop()
    finally:
        etcd.stop()


def _timed_move(user: str, operator: Path) -> dict[str, Any]:
    started = time.monotonic()
    done = subprocess.run([sys.executable, "-m", "sandboxd", "users", "move", user, "--to", "b", "--json",
                           "--config", str(operator)], capture_output=True, text=True, timeout=1800, check=False)
    seconds = time.monotonic() - started
    if done.returncode != 0:
        raise RuntimeError(f"the move failed: {done.stderr.strip()[:600]}")
    return {"move_s": seconds, "result": json.loads(done.stdout)}


if __name__ == "__main__":
    import tempfile

    from sandboxd.config import RUNNER_IMAGE

    with tempfile.TemporaryDirectory(prefix="bench-move-") as tmp:
        print(json.dumps(move_cost(Path(tmp), "solo", RUNNER_IMAGE, mib=int(sys.argv[1]) if len(sys.argv) > 1 else 1024,
                                   say=lambda text: print(text, file=sys.stderr)), indent=2))
