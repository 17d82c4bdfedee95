"""The one redaction step: sensitive keys and registered secret values never reach a log line."""

from __future__ import annotations

import io
import json

from sandboxd.logging import (LogBudget, configure_logging, get_logger, lines_dropped, log_dropped_summary, secret_values,
                              set_log_budget, source)


def test_secrets_are_masked_wherever_they_appear() -> None:
    stream = io.StringIO()
    configure_logging("debug", "json", stream)
    log = get_logger("test")
    with secret_values(["s3cr3t-token", "x"]):
        log.info("call", env={"OFFICER_APIFY_TOKEN": "s3cr3t-token"}, line="[call_1] using s3cr3t-token now",
                 nested={"args": ["s3cr3t-token"]}, short="x")
    log.info("after", line="s3cr3t-token")
    first, second = (json.loads(line) for line in stream.getvalue().splitlines())
    assert first["env"] == {"OFFICER_APIFY_TOKEN": "***"}
    assert first["line"] == "[call_1] using *** now"
    assert first["nested"] == {"args": ["***"]}
    assert first["short"] == "x"  # too short to mask by value
    assert second["line"] == "s3cr3t-token"  # outside the call, nothing is registered


def test_console_format_on_request() -> None:
    stream = io.StringIO()
    configure_logging("info", "console", stream)
    get_logger("test").info("hello", token="abc")
    text = stream.getvalue()
    assert "hello" in text and "abc" not in text
    get_logger("test").debug("hidden")
    assert "hidden" not in stream.getvalue()


# -- the log's budgets -------------------------------------------------------------------


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_a_source_over_its_budget_is_dropped_and_counted_and_refills_at_its_rate() -> None:
    clock = Clock()
    budget = LogBudget(rate=2, burst=5, clock=clock)
    noisy, quiet = source("sandbox", "abc"), source("sandbox", "def")
    assert [budget.admit(noisy, "egress") for _ in range(8)] == [True] * 5 + [False] * 3
    assert budget.admit(quiet, "egress")  # another source has its own bucket
    clock.now += 1.0  # two lines' worth
    assert [budget.admit(noisy, "egress") for _ in range(3)] == [True, True, False]
    summary = budget.summary()
    assert summary is not None and summary["dropped"] == 4 and summary["sources"] == 1
    assert summary["by_source"] == [{"source": "sandbox", "who": "abc", "event": "egress", "dropped": 4}]
    assert budget.summary() is None  # said once: the counts start again


def test_endless_made_up_sources_are_bounded_by_the_shared_budget() -> None:
    clock = Clock()
    budget = LogBudget(rate=1, burst=10, clock=clock)
    admitted = sum(budget.admit(source("user", f"made-up-{i}@x.io"), "call") for i in range(10_000))
    # Each source's first line would pass alone; together they get TOTAL_SOURCES sources' burst.
    assert admitted == 10 * LogBudget.TOTAL_SOURCES
    summary = budget.summary()
    assert summary is not None and summary["dropped"] == 10_000 - admitted and len(summary["by_source"]) == 10


def test_lines_over_budget_are_never_rendered_and_the_budget_key_never_is() -> None:
    stream = io.StringIO()
    configure_logging("info", "json", stream)
    set_log_budget(rate=0.001, burst=3)
    try:
        log = get_logger("test")
        for i in range(50):
            log.info("egress", n=i, budget=source("sandbox", "s1"))
        log.info("unbudgeted")
        lines = [json.loads(line) for line in stream.getvalue().splitlines()]
        assert [line.get("n") for line in lines] == [0, 1, 2, None]
        assert all("budget" not in line for line in lines)
        log_dropped_summary()
        (summary,) = [json.loads(line) for line in stream.getvalue().splitlines()][4:]
        assert summary["event"] == "log_lines_dropped" and summary["dropped"] == 47
        assert summary["by_source"][0] == {"source": "sandbox", "who": "s1", "event": "egress", "dropped": 47}
        assert lines_dropped()["sandbox"] >= 47  # the metrics' count, since start
    finally:
        set_log_budget(rate=10, burst=100)


def test_auto_is_json_off_a_terminal_and_console_has_no_colour_there() -> None:
    stream = io.StringIO()  # not a terminal
    configure_logging("info", "auto", stream)
    get_logger("test").info("piped", value="\x1b[2J")
    assert json.loads(stream.getvalue())["value"] == "\x1b[2J"
    assert "\x1b" not in stream.getvalue()  # json escapes it
    stream = io.StringIO()
    configure_logging("info", "console", stream)
    get_logger("test").info("asked", plain="x", hostile="\x1b]0;t\x07", spaced="a \x1b[2J b", bidi="a\u202eb")
    text = stream.getvalue()
    assert "\x1b" not in text and "\x07" not in text and "\u202e" not in text  # no colour either: not a terminal
    assert "plain=x" in text and r"hostile='\x1b]0;t\x07'" in text and r"bidi='a\u202eb'" in text
