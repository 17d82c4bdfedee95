"""Config: YAML, SANDBOXD_* variables and flags, in that order; bad keys stop start-up by name."""

from __future__ import annotations

from pathlib import Path

import pytest

from sandboxd.config import RUNNER_IMAGE, Config, iter_keys, load_config
from sandboxd.errors import ConfigError

REPO = Path(__file__).resolve().parents[2]


def test_defaults_need_no_file() -> None:
    config = load_config(environ={})
    assert config.backend == "docker"
    assert config.sandbox.read_only_root and config.sandbox.no_new_privileges
    assert config.socket_mode == 0o660


def test_yaml_then_env_then_flags(tmp_path: Path) -> None:
    path = tmp_path / "config.yaml"
    path.write_text("socket_mode: '0600'\npool:\n  max_per_user: 2\n  min_idle: 3\nsandbox:\n  network: none\n")
    config = load_config(path, environ={"SANDBOXD_POOL_MIN_IDLE": "5", "SANDBOXD_CALLS_ALLOWED_ENV": "[A, B]"},
                         overrides={"data_path": tmp_path / "d", "socket": None})
    assert config.pool.max_per_user == 2 and config.pool.min_idle == 5
    assert config.calls.allowed_env == ["A", "B"]
    assert config.sandbox.network == "none"
    assert config.socket_mode == 0o600
    assert config.data_path == tmp_path / "d"


@pytest.mark.parametrize(
    ("text", "fragment"),
    [
        ("pool:\n  max_per_usr: 2\n", "pool.max_per_usr: unknown key"),
        ("pool:\n  max_per_user: 0\n", "pool.max_per_user"),
        ("bogus: 1\n", "bogus: unknown key"),
        ("sandbox:\n  cpus: lots\n", "sandbox.cpus"),
        ("socket_mode: '0999'\n", "socket_mode"),
        ("pool: [1, 2\n", "not valid YAML at line"),
        ("- a\n- b\n", "must hold a mapping"),
        ("sandbox:\n  transport: pipes\n", "sandbox.transport"),
        ("sandbox:\n  docker_host: tcp://10.0.0.5:2376\n", "set sandbox.transport: attach for a remote engine"),
    ],
)
def test_bad_files_name_the_key(tmp_path: Path, text: str, fragment: str) -> None:
    path = tmp_path / "config.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError) as info:
        load_config(path, environ={})
    assert fragment in info.value.message


def test_unknown_env_variable_is_an_error() -> None:
    with pytest.raises(ConfigError) as info:
        load_config(environ={"SANDBOXD_POOL_MAX_PER_USR": "3"})
    assert "SANDBOXD_POOL_MAX_PER_USR" in info.value.message


def test_env_sets_keys_of_the_optional_cluster_section_and_its_tls(tmp_path: Path) -> None:
    # A Swarm task's name and address come from the environment (packaging/swarm/stack.yml).
    path = tmp_path / "config.yaml"
    path.write_text("cluster:\n  etcd: ['http://etcd1:2379']\n  tls: {cert: /a.pem, key: /a.key, ca: /ca.pem}\n")
    config = load_config(path, environ={"SANDBOXD_CLUSTER_NODE": "host1", "SANDBOXD_CLUSTER_ADVERTISE": "sandboxd-host1:7443",
                                        "SANDBOXD_CLUSTER_TLS_CA": "/other-ca.pem"})
    assert config.cluster is not None
    assert (config.cluster.node, config.cluster.advertise) == ("host1", "sandboxd-host1:7443")
    assert (str(config.cluster.tls.cert), str(config.cluster.tls.ca)) == ("/a.pem", "/other-ca.pem")


def test_missing_file_is_an_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as info:
        load_config(tmp_path / "nope.yaml", environ={})
    assert "does not exist" in info.value.message


def test_every_key_is_documented() -> None:
    doc = (REPO / "docs" / "config.md").read_text()
    for key, env, _default, description in iter_keys(Config):
        assert f"`{key}`" in doc and f"`{env}`" in doc, key
        assert description, f"{key} has no description"


def test_default_image_matches_the_image_version() -> None:
    version = (REPO / "images" / "node" / "VERSION").read_text().strip()
    assert RUNNER_IMAGE == f"sandboxd/node:{version}"


def test_one_version_for_the_daemon_and_its_image(capsys: pytest.CaptureFixture[str]) -> None:
    """Issue 29: `sandboxd --version` said 0.1.0 while the image was 0.4.0."""
    from sandboxd import __version__
    from sandboxd.cli.main import main

    version = (REPO / "images" / "node" / "VERSION").read_text().strip()
    assert __version__ == version
    assert 'version = {attr = "sandboxd.__version__"}' in (REPO / "pyproject.toml").read_text()
    with pytest.raises(SystemExit) as exited:
        main(["--version"])
    assert exited.value.code == 0
    assert capsys.readouterr().out == f"sandboxd {version} (runner image sandboxd/node:{version})\n"


def test_a_remote_engine_works_over_attach(tmp_path: Path) -> None:
    path = tmp_path / "config.yaml"
    path.write_text("sandbox:\n  docker_host: tcp://10.0.0.5:2376\n  transport: attach\n")
    assert load_config(path, environ={}).sandbox.transport == "attach"


def test_event_loop_auto_is_uvloop_when_installed_and_asyncio_on_request() -> None:
    import uvloop

    from sandboxd.cli.serve_cmds import event_loop_factory

    assert event_loop_factory("auto") is uvloop.new_event_loop
    assert event_loop_factory("uvloop") is uvloop.new_event_loop
    assert event_loop_factory("asyncio") is None  # asyncio.Runner's default loop


def test_event_loop_uvloop_without_uvloop_names_the_fix(monkeypatch: pytest.MonkeyPatch) -> None:
    import sys

    from sandboxd.cli.serve_cmds import event_loop_factory

    monkeypatch.setitem(sys.modules, "uvloop", None)  # import uvloop raises ImportError
    assert event_loop_factory("auto") is None
    with pytest.raises(ConfigError) as info:
        event_loop_factory("uvloop")
    assert "pip install uvloop" in info.value.message and "event_loop: asyncio" in info.value.message
