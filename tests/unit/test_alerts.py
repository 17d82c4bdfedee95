"""packaging/prometheus/: the alerting rules load, fire and stay quiet as their unit tests say, and name real series.

promtool (Debian's `prometheus` package; scripts/ci-deps.sh installs it) checks the rules and runs
sandboxd-alerts.test.yml, where each alert has series that fire it and series that must not.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from sandboxd.server.server import Server
from tests.unit.test_metrics import call, run_server

REPO = Path(__file__).resolve().parents[2]
RULES = REPO / "packaging" / "prometheus" / "sandboxd-alerts.yml"
RULE_TESTS = REPO / "packaging" / "prometheus" / "sandboxd-alerts.test.yml"
INSTALL_DOC = REPO / "docs" / "install.md"
# Issue 35's disk quota (storage:): a user near their quota is the one alert an operator can act on before a user is stuck.
DISK_QUOTA_SERIES = frozenset({"sandboxd_user_disk_bytes", "sandboxd_user_disk_limit_bytes", "sandboxd_user_disk_inodes",
                               "sandboxd_user_disk_limit_inodes", "sandboxd_quota_refusals_total"})


def promtool() -> str:
    """The promtool binary: a skip on a developer's machine without it, a failure in CI (never a silent skip there)."""
    found = shutil.which("promtool")
    if found is None:
        why = "promtool missing: apt-get install --no-install-recommends prometheus (scripts/ci-deps.sh does)"
        if os.environ.get("CI"):
            pytest.fail(f"{why}; CI must run the alert tests")
        pytest.skip(why)
    return found


def run_promtool(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([promtool(), *args], capture_output=True, text=True, timeout=120)


def rules() -> list[dict[str, Any]]:
    return [rule for group in yaml.safe_load(RULES.read_text())["groups"] for rule in group["rules"]]


def test_promtool_check_rules_accepts_the_rules() -> None:
    proc = run_promtool("check", "rules", str(RULES))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert f"SUCCESS: {len(rules())} rules found" in proc.stdout


def test_promtool_unit_tests_pass() -> None:
    proc = run_promtool("test", "rules", str(RULE_TESTS))
    assert proc.returncode == 0 and "SUCCESS" in proc.stdout, proc.stdout + proc.stderr


def test_every_alert_has_a_case_that_fires_it(tmp_path: Path) -> None:
    """Every alert silenced (its expression never true) fails the unit tests, each alert by name."""
    alerts = [rule["alert"] for rule in rules()]
    tested = yaml.safe_load(RULE_TESTS.read_text())
    fired = {case["alertname"] for test in tested["tests"] for case in test["alert_rule_test"] if case["exp_alerts"]}
    assert fired == set(alerts)
    doc = yaml.safe_load(RULES.read_text())
    for group in doc["groups"]:
        for rule in group["rules"]:
            rule["expr"] = "vector(1) == 0"
    (tmp_path / RULES.name).write_text(yaml.safe_dump(doc))
    shutil.copy(RULE_TESTS, tmp_path / RULE_TESTS.name)
    proc = run_promtool("test", "rules", str(tmp_path / RULE_TESTS.name))
    report = proc.stdout + proc.stderr
    assert proc.returncode != 0
    assert not [alert for alert in alerts if f"alertname: {alert}," not in report], report


def test_every_alert_has_a_case_where_it_must_not_fire() -> None:
    """A case with no alert expected, or one whose series hold a second instance or user left out of what fires."""
    tested = yaml.safe_load(RULE_TESTS.read_text())
    quiet: set[str] = set()
    for test in tested["tests"]:
        series = " ".join(s["series"] for s in test["input_series"])
        for case in test["alert_rule_test"]:
            expected = [alert["exp_labels"] for alert in case["exp_alerts"]]
            if not expected:
                quiet.add(case["alertname"])
            elif any(f'"{value}"' in series and all(e.get(key) != value for e in expected)
                     for key in ("instance", "user") for value in re.findall(rf'{key}="([^"]+)"', series)):
                quiet.add(case["alertname"])
    assert quiet == {rule["alert"] for rule in rules()}


def exported_series(server: Server) -> set[str]:
    """Every sample name the daemon's /metrics can hold (counters as *_total, histograms' three series)."""
    names: set[str] = set()
    for family in text_string_to_metric_families(server.metrics.render()[0].decode()):  # type: ignore[union-attr]
        suffixes = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count")}.get(family.type, ("",))
        names.update(family.name + suffix for suffix in suffixes)
    return names


def test_the_rules_name_series_the_daemon_exports(tmp_path: Path) -> None:
    found: set[str] = set()

    async def scrape(server: Server) -> None:
        await call(server, "world")
        found.update(exported_series(server))

    run_server(tmp_path, scrape, metrics={"listen": "127.0.0.1:0"})
    used = {name for rule in rules() for name in re.findall(r"\b(sandboxd_[a-z_]+)", rule["expr"])}
    assert "sandboxd_calls_total" in found and "sandboxd_queue_wait_seconds_bucket" in found
    assert used == found & used, f"series no sandboxd exports: {sorted(used - found)}"
    assert DISK_QUOTA_SERIES <= used, "the disk quota's series each have a rule"


def test_every_alert_has_a_runbook_line_in_install_md() -> None:
    text = INSTALL_DOC.read_text()
    section = text.split("\n## Alerts\n", 1)[1].split("\n## ", 1)[0]
    for rule in rules():
        assert rule["annotations"]["runbook_url"].endswith("/install.md#alerts"), rule["alert"]
        assert rule["labels"]["severity"] in ("critical", "warning"), rule["alert"]
        row = next((line for line in section.splitlines() if line.startswith(f"| `{rule['alert']}`")), None)
        assert row is not None, f"docs/install.md's Alerts has no row for {rule['alert']}"
        assert row.count("|") >= 4 and len(row.split("|")[3].strip()) > 10, f"{rule['alert']}: say what to do"
