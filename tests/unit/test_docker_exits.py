"""Why a Docker sandbox ended: an out-of-memory kill is told as one even when the engine's flag missed it."""

from __future__ import annotations

from typing import Any

from sandboxd.sandbox.docker.exits import exit_message, exit_state


class Engine:
    """The two calls exit_state makes, answering as an engine would: its record, and its log of 'oom' events."""

    def __init__(self, state: dict[str, Any], oom_events: int) -> None:
        self.state, self.oom_events = state, oom_events
        self.event_queries: list[dict[str, Any]] = []

    def inspect_container(self, container_id: str) -> dict[str, Any]:
        return {"Id": container_id, "State": self.state}

    def events(self, **query: Any) -> Any:
        self.event_queries.append(query)
        return iter([{"status": "oom", "id": query["filters"]["container"]}] * self.oom_events)


def test_a_sigkill_the_engine_logged_as_oom_is_told_as_out_of_memory() -> None:
    # The exit reached the engine before the kernel's OOM event: OOMKilled false, the 'oom' event logged.
    engine = Engine({"Running": False, "ExitCode": 137, "OOMKilled": False}, oom_events=1)
    state = exit_state(engine, "c1")  # type: ignore[arg-type]
    assert state["OOMKilled"] is True
    assert engine.event_queries[0]["filters"] == {"container": "c1", "event": "oom"}
    assert "ran out of memory" in exit_message(state, "96m", "") and "96m" in exit_message(state, "96m", "")


def test_a_sigkill_without_an_oom_event_stays_a_sigkill() -> None:
    engine = Engine({"Running": False, "ExitCode": 137, "OOMKilled": False}, oom_events=0)
    state = exit_state(engine, "c1")  # type: ignore[arg-type]
    assert state["OOMKilled"] is False
    assert exit_message(state, "96m", "") == "The tool's sandbox was killed (SIGKILL) during the call."


def test_the_event_log_is_read_only_for_a_bare_sigkill() -> None:
    for state in ({"Running": False, "ExitCode": 137, "OOMKilled": True}, {"Running": False, "ExitCode": 3},
                  {"Running": True, "ExitCode": 0}):
        engine = Engine(dict(state), oom_events=1)
        assert exit_state(engine, "c1") == state  # type: ignore[arg-type]
        assert engine.event_queries == []
