"""One swarm of three local engines and the stack deployed on it, for the whole session.

Made once (about a minute: three engines, the images loaded on each, deploy.sh) and removed at
the end whatever happened; a swarm a killed run left behind is removed first.
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path
from typing import Iterator

import pytest

from tests.swarm import harness
from tests.swarm.stack import Stack, build_images

REPORT = Path(tempfile.gettempdir()) / "sandboxd-swarm-failure.log"  # written when a test failed


@pytest.fixture(scope="session")
def stack(request: pytest.FixtureRequest) -> Iterator[Stack]:
    reason = harness.unusable()
    if reason:
        pytest.skip(f"the Swarm e2e cannot run here: {reason}")
    for stale in harness.leftovers(manual=False):
        stale.down()
    build_images()
    swarm = harness.Swarm()
    deployed = Stack(swarm)
    report: Path | None = None
    started = time.monotonic()
    try:
        swarm.up()
        deployed.deploy()
        print(f"\nswarm: engines up and joined in {time.monotonic() - started - deployed.deploy_s - deployed.healthy_s:.1f} s, "
              f"deploy.sh {deployed.deploy_s:.1f} s, every sandboxd healthy {deployed.healthy_s:.1f} s later; "
              f"{swarm.rss_bytes() / 1e9:.2f} GB resident")
        yield deployed
        report = REPORT if request.session.testsfailed else None
    except BaseException:
        report = REPORT
        raise
    finally:
        if report is not None and swarm.hosts and swarm.manager.alive():
            report.write_text(deployed.diagnose())
            print(f"\nswarm: the tasks' history and the daemons' last lines: {report}")
        swarm.down()
