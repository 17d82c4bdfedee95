"""The cluster's commands when they cannot answer: the exit status and what stderr says."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from sandboxd.cli.main import main


def _closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])  # nothing listens there once the socket is closed


def test_without_a_cluster_section_it_is_a_usage_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    config = tmp_path / "config.yaml"
    config.write_text("pool:\n  min_idle: 0\n")
    assert main(["nodes", "list", "--config", str(config)]) == 2
    assert "no cluster: section" in capsys.readouterr().err


@pytest.mark.parametrize("command", [["users", "where", "alice@example.com"], ["nodes", "list"], ["nodes", "drain", "a"],
                                     ["nodes", "undrain", "a"], ["users", "move", "alice@example.com", "--to", "b"]])
def test_an_etcd_that_does_not_answer_is_named_with_exit_1(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                           command: list[str]) -> None:
    url = f"http://127.0.0.1:{_closed_port()}"
    config = tmp_path / "config.yaml"
    config.write_text(f"cluster:\n  etcd: [{url}]\n  tls: {{cert: c.pem, key: k.pem, ca: ca.pem}}\n")
    assert main([*command, "--config", str(config)]) == 1
    err = capsys.readouterr().err
    assert url in err and "check that etcd runs there" in err
