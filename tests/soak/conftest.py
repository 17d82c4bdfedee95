"""The soak test runs only on demand: `make soak` (pytest tests/soak -m soak -s).

A plain `pytest tests` (make test) collects it and skips it with a reason, so the
default run stays short.
"""

from __future__ import annotations

import pytest


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if "soak" in (config.getoption("markexpr") or "").replace("not soak", ""):
        return
    skip = pytest.mark.skip(reason="soak test: run it on demand with `make soak` (pytest tests/soak -m soak -s)")
    for item in items:
        if item.get_closest_marker("soak"):
            item.add_marker(skip)
