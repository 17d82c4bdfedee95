"""The disk quota's configuration, usage walk, refusals and metrics (storage/), without Docker."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import pytest

from sandboxd.config import ConfigError, load_config, parse_size
from sandboxd.errors import QuotaExceeded
from sandboxd.service.metrics import _storage_metrics
from sandboxd.storage.quota import Storage, UserUsage
from sandboxd.storage.usage import Usage, measure

MIB = 1 << 20


def test_sizes_parse_like_docker_memory() -> None:
    assert parse_size("5g") == 5 << 30
    assert parse_size("20M") == 20 * MIB
    assert parse_size("512KiB") == 512 << 10
    assert parse_size("1.5g") == 3 << 29
    assert parse_size(4096) == 4096
    for bad in ("five", "-1g", "5x", "", True):
        with pytest.raises(ValueError, match="is not a size"):
            parse_size(bad)


def test_storage_keys_default_and_come_from_the_environment() -> None:
    default = load_config(environ={}).storage
    assert (default.quota_bytes, default.quota_inodes, default.enforcement) == (5 << 30, 500_000, "auto")
    config = load_config(environ={"SANDBOXD_STORAGE_QUOTA_BYTES": "20m", "SANDBOXD_STORAGE_ENFORCEMENT": "soft",
                                  "SANDBOXD_STORAGE_USERS": "{Big@Example.com: {quota_bytes: 1g}}"})
    storage = config.storage
    assert storage.quota_bytes == 20 * MIB and storage.enforcement == "soft"
    assert storage.limits("big@example.com") == (1 << 30, 500_000)  # names are lower-cased like users
    assert storage.limits("other@example.com") == (20 * MIB, 500_000)


@pytest.mark.parametrize(("env", "words"), [
    ({"SANDBOXD_STORAGE_QUOTA_BYTES": "lots"}, "storage.quota_bytes: 'lots' is not a size"),
    ({"SANDBOXD_STORAGE_ENFORCEMENT": "strict"}, "storage.enforcement"),
    ({"SANDBOXD_STORAGE_USERS": "{not-a-user: {quota_bytes: 1g}}"}, "storage.users"),
])
def test_bad_storage_settings_stop_start_up_naming_the_key(env: dict[str, str], words: str) -> None:
    with pytest.raises(ConfigError, match=words):
        load_config(environ=env)


def test_usage_counts_blocks_not_sizes_and_never_follows_links(tmp_path: Path) -> None:
    user = tmp_path / "user"
    user.mkdir()
    (user / "dense").write_bytes(b"x" * MIB)
    with open(user / "sparse", "wb") as sparse:
        sparse.truncate(1 << 40)  # a TiB that takes no blocks
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "big").write_bytes(b"y" * 4 * MIB)
    os.symlink(outside, user / "link")  # a link to a folder: neither followed nor walked
    os.link(user / "dense", user / "dense2")  # a second name: counted once
    os.sync()
    usage = measure([user, tmp_path / "missing"], 1000)
    assert usage.complete and usage.inodes == 4  # the folder, dense (dense2 is the same file), sparse, link
    assert MIB <= usage.bytes < 2 * MIB


def test_usage_walk_stops_past_the_inode_limit(tmp_path: Path) -> None:
    for i in range(50):
        (tmp_path / str(i)).mkdir()
    usage = measure([tmp_path], 10)
    assert not usage.complete and usage.inodes == 11


def _storage(tmp_path: Path, **storage: object) -> Storage:
    config = load_config(environ={}, overrides={"data_path": tmp_path, "storage": storage})
    return Storage(config)


def test_soft_mode_refuses_a_user_over_quota_until_they_hold_less(tmp_path: Path) -> None:
    store = _storage(tmp_path, quota_bytes="1m", quota_inodes=100, enforcement="auto")
    store.resolve()  # tmp is no btrfs with quota: soft
    assert [p.mode for p in store.places] == ["soft", "soft"]
    user = "alice@example.com"
    folder = tmp_path / user
    folder.mkdir()
    assert store.refusal(user) is None and user not in store.over_quota  # never measured: let in
    (folder / "big").write_bytes(b"z" * 2 * MIB)
    os.sync()
    store.measure_now(user)
    assert user in store.over_quota  # what a call asks before it asks for the refusal
    refusal = store.refusal(user)
    assert isinstance(refusal, QuotaExceeded) and refusal.code == -32004
    assert "2.0 MiB" in refusal.message and "1.0 MiB" in refusal.message and "storage.quota_bytes" in refusal.message
    assert refusal.data["limitBytes"] == MIB and store.refusals == 1
    (folder / "big").unlink()
    for i in range(150):
        (folder / str(i)).touch()
    store.measure_now(user)
    refusal = store.refusal(user)
    assert refusal is not None and "storage.quota_inodes" in refusal.message
    for i in range(150):
        (folder / str(i)).unlink()
    store.measure_now(user)
    assert store.refusal(user) is None and user not in store.over_quota
    row = store.status()["users"][user]
    assert row["limitBytes"] == MIB and row["limitInodes"] == 100 and not row["over"]
    store.close()


def test_a_soft_refusal_names_the_biggest_entries_as_the_sandbox_sees_them_and_the_operators_command(
        tmp_path: Path) -> None:
    store = _storage(tmp_path, quota_bytes="1m", enforcement="soft")
    store.resolve()
    user = "bob@example.com"
    (tmp_path / user / "cache" / "deep").mkdir(parents=True)
    (tmp_path / user / "cache" / "deep" / "blob").write_bytes(b"c" * 3 * MIB)
    (tmp_path / user / "notes.txt").write_bytes(b"n" * MIB)
    (tmp_path / user / "small").write_bytes(b"s")
    (tmp_path / "email" / user).mkdir(parents=True)
    (tmp_path / "email" / user / "emails.db").write_bytes(b"e" * 2 * MIB)
    os.sync()
    store.measure_now(user)
    refusal = store.refusal(user)
    assert refusal is not None
    assert [entry["path"] for entry in refusal.data["biggest"]] == \
        ["/officer/user/cache", "/officer/data/emails.db", "/officer/user/notes.txt"]  # all below each, most first
    assert refusal.data["biggest"][0]["bytes"] >= 3 * MIB
    assert "the biggest: /officer/user/cache (3.0 MiB), /officer/data/emails.db (2.0 MiB)" in refusal.message
    assert f"`sandboxd storage free {user} /officer/user/cache`" in refusal.message
    store.close()


def test_a_note_names_the_limit_a_failed_write_hit(tmp_path: Path) -> None:
    store = _storage(tmp_path, quota_bytes="2m", quota_inodes=100)
    store.resolve()
    user = "bob@example.com"
    (tmp_path / user).mkdir()
    assert asyncio.run(store.note(user)) is None  # ENOSPC elsewhere (a full /tmp): no quota to blame
    (tmp_path / user / "f").write_bytes(b"q" * (2 * MIB - 4096))
    os.sync()
    note = asyncio.run(store.note(user))
    assert note is not None and "storage.quota_bytes" in note and "Delete files" in note
    store.close()


def test_off_unquoted_in_yaml_or_the_environment_is_off(tmp_path: Path) -> None:
    (tmp_path / "c.yaml").write_text("storage:\n  enforcement: off\n")
    assert load_config(tmp_path / "c.yaml", environ={}).storage.enforcement == "off"
    assert load_config(environ={"SANDBOXD_STORAGE_ENFORCEMENT": "off"}).storage.enforcement == "off"


def test_off_never_refuses_and_measures_nothing(tmp_path: Path) -> None:
    store = _storage(tmp_path, enforcement="off")
    store.resolve()
    store.after_call("carol@example.com")
    assert store.refusal("carol@example.com") is None and store.status()["users"] == {}
    store.close()


def test_hard_stops_start_up_where_the_kernel_cannot_enforce(tmp_path: Path) -> None:
    store = _storage(tmp_path, enforcement="hard")
    with pytest.raises(ConfigError, match="not on a btrfs filesystem.*storage.enforcement: auto or soft"):
        store.resolve()
    store.close()


def test_the_metrics_give_each_users_usage_and_limit() -> None:
    usage = UserUsage(Usage(3 * MIB, 12, True), 8 * MIB, 100, False, 0.0)
    storage = {"refusals": 2, "users": {"dave@example.com": {"bytes": usage.usage.bytes, "limitBytes": usage.limit_bytes,
                                                             "inodes": 12, "limitInodes": 100}}}
    samples = {(s.name, s.labels.get("user")): s.value for family in _storage_metrics(storage) for s in family.samples}
    assert samples[("sandboxd_user_disk_bytes", "dave@example.com")] == 3 * MIB
    assert samples[("sandboxd_user_disk_limit_bytes", "dave@example.com")] == 8 * MIB
    assert samples[("sandboxd_user_disk_inodes", "dave@example.com")] == 12
    assert samples[("sandboxd_user_disk_limit_inodes", "dave@example.com")] == 100
    assert samples[("sandboxd_quota_refusals_total", None)] == 2


def test_sandboxd_status_shows_each_users_usage_and_limit(tmp_path: Path) -> None:
    from sandboxd.cli.client_cmds import format_status

    store = _storage(tmp_path, quota_bytes="1m")
    store.resolve()
    (tmp_path / "erin@example.com").mkdir()
    (tmp_path / "erin@example.com" / "f").write_bytes(b"e" * 2 * MIB)
    os.sync()
    store.measure_now("erin@example.com")
    status = {"version": "x", "backend": "docker", "uptimeS": 1, "connections": 0, "callsInFlight": 0,
              "pool": {"totals": {"idle": 0, "busy": 0, "starting": 0, "waiting": 0}, "users": {}},
              "storage": store.status()}
    text = format_status(status)
    assert "disk quota: data folders soft, email folders soft; 0 calls refused over quota" in text
    assert "erin@example.com: 2.0 MiB of 1.0 MiB, 2 of 500000 files — OVER QUOTA" in text
    store.close()
