"""Reading tool results in e2e tests: the text, and asserting success or a readable refusal."""

from __future__ import annotations

from typing import Any


def text(result: dict[str, Any]) -> str:
    return "\n".join(c["text"] for c in result["content"])


def ok(result: dict[str, Any]) -> str:
    assert result["isError"] is False, text(result)
    return text(result)


def refused(result: dict[str, Any], *words: str) -> str:
    message = text(result)
    assert result["isError"] is True, message
    for word in words:
        assert word in message, message
    return message
