"""The one redaction step: sensitive keys and registered secret values never reach a log line."""

from __future__ import annotations

import io
import json

from sandboxd.logging import configure_logging, get_logger, secret_values


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
