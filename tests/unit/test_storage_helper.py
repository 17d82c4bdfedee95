"""The privileged quota helper's request handling (storage/helper.py) and btrfs provisioning on a loop filesystem."""

from __future__ import annotations

import json
import os
import socket
import struct
import subprocess
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from sandboxd.config import AUTO_SANDBOX_ID, load_config
from sandboxd.sandbox.mounts import acl_users
from sandboxd.storage import btrfs
from sandboxd.storage.helper import handle, serve_connection
from sandboxd.storage.quota import Storage, provision_user

from tests.loopfs import MIB, loop_devices_usable, loop_filesystem

ME, MY_GROUP = os.getuid(), os.getgid()
SANDBOX_UID = AUTO_SANDBOX_ID


def _config(data: Path, **storage: Any) -> Any:
    return load_config(environ={}, overrides={"data_path": data, "storage": storage})


def _ask(line: bytes, data: Path, *, uid: int = ME) -> dict[str, Any]:
    return handle(line, uid, MY_GROUP, daemon_uid=ME, config=_config(data))


def test_only_the_daemons_uid_is_served(tmp_path: Path) -> None:
    answer = _ask(b'{"op": "check"}', tmp_path, uid=ME + 1)
    assert "is not the sandboxd daemon's" in answer["error"]
    assert _ask(b'{"op": "check"}', tmp_path) == {"ok": True}


@pytest.mark.parametrize(("line", "words"), [
    (b"not json", "not a JSON line"),
    (b'["provision"]', "must be"),
    (b'{"op": "provision", "user": "a@x.io", "path": "/etc"}', "must be"),  # never a path from the caller
    (b'{"op": "chown"}', "unknown op"),
    (b'{"op": "provision", "user": "../../etc@x"}', "is not an email address"),
    (b'{"op": "provision", "user": "a@x.io/../b"}', "is not an email address"),
    (b'{"op": "provision", "user": "Alice@X.io"}', "checked (lower-case) form"),
    (b'{"op": "provision", "user": 7}', "must be a string"),
    # The kill (sandbox/docker/sentry.py): a container in full, never a pid, checked before the engine is asked.
    (b'{"op": "kill", "container": "' + b"c0ffee" * 10 + b'abcd", "pid": 1}', "must be sent with ['container']"),
    (b'{"op": "kill"}', "must be sent with ['container']"),
    (b'{"op": "kill", "container": "c0ffee"}', "not a container id in full"),
    (b'{"op": "kill", "container": ["c0ffee"]}', "not a container id in full"),
])
def test_requests_other_than_a_checked_user_name_are_refused(tmp_path: Path, line: bytes, words: str) -> None:
    answer = _ask(line, tmp_path)
    assert words in answer["error"], answer
    assert os.listdir(tmp_path) == []  # nothing was made


def test_a_provision_request_on_a_filesystem_without_quota_changes_nothing(tmp_path: Path) -> None:
    assert _ask(b'{"op": "provision", "user": "a@x.io"}', tmp_path) == {"ok": True, "areas": {"data": "soft", "email": "soft"}}
    assert not (tmp_path / "a@x.io").exists()


def test_one_request_one_answer_over_a_socket_with_the_peers_credentials(tmp_path: Path) -> None:
    ours, theirs = socket.socketpair()
    with ours, theirs:
        theirs.sendall(b'{"op": "check"}\n')
        serve_connection(ours, daemon_uid=ME, config=_config(tmp_path))
        assert json.loads(theirs.recv(4096)) == {"ok": True}
    ours, theirs = socket.socketpair()
    with ours, theirs:
        theirs.sendall(b"x" * 5000)  # no newline within the bound: refused, not read for ever
        serve_connection(ours, daemon_uid=ME, config=_config(tmp_path))
        assert "longer than" in json.loads(theirs.recv(4096))["error"]



def test_a_stranger_is_refused_before_a_byte_of_its_request_is_read(tmp_path: Path) -> None:
    ours, theirs = socket.socketpair()
    with ours, theirs:
        theirs.sendall(b'{"op": "check"}\n')
        serve_connection(ours, daemon_uid=ME + 1, config=_config(tmp_path))
        assert "is not the sandboxd daemon's" in json.loads(theirs.recv(4096))["error"]
        assert ours.recv(4096, socket.MSG_DONTWAIT) == b'{"op": "check"}\n'  # still there: never read


@pytest.mark.parametrize("trickle", [False, True])
def test_a_peer_that_sends_no_whole_line_is_answered_within_a_second(tmp_path: Path, trickle: bool) -> None:
    ours, theirs = socket.socketpair()
    with ours, theirs:
        stop = threading.Event()

        def drip() -> None:  # a byte every 0.1 s for 3 s: each one must not start the wait again
            for _ in range(30 if trickle else 0):
                if stop.wait(0.1):
                    return
                theirs.send(b"{")

        dripping = threading.Thread(target=drip)
        dripping.start()
        started = time.monotonic()
        serve_connection(ours, daemon_uid=ME, config=_config(tmp_path))
        took = time.monotonic() - started
        stop.set()
        dripping.join()
        assert took < 1.0, f"the helper waited {took:.1f} s for a line that never came"
        assert "no whole request line within" in json.loads(theirs.recv(4096).split(b"\n")[0])["error"]


BTRFS_PROBLEM = loop_devices_usable("btrfs")


@pytest.mark.skipif(bool(BTRFS_PROBLEM), reason=str(BTRFS_PROBLEM))
def test_provisioning_makes_subvolumes_under_one_limited_qgroup_per_user(tmp_path: Path) -> None:
    with loop_filesystem(tmp_path / "data", "btrfs", 256) as data:
        config = _config(data, quota_bytes="20m", enforcement="hard", users={"big@x.io": {"quota_bytes": "40m"}})
        store = Storage(config)
        store.resolve()  # as root on btrfs with quota: hard, in-process
        assert [(p.area.name, p.mode) for p in store.places] == [("data", "hard"), ("email", "hard")]
        (data / "old@x.io").mkdir()  # made before the quota
        done = provision_user(config, "a@x.io", (1234, 5678))
        assert done["data"] == done["email"] and done["data"].startswith("hard:")
        user, mail = data / "a@x.io", data / "email" / "a@x.io"
        for folder in (user, mail):
            info = os.stat(folder)
            assert info.st_ino == btrfs.SUBVOLUME_ROOT_INO and (info.st_uid, info.st_gid) == (1234, 5678)
            assert info.st_mode & 0o707 == 0o700 and acl_users(folder)[SANDBOX_UID] == 7  # ready for a sandbox
        fs_id, group = done["data"].split(":")[1:]
        assert btrfs.qgroup_usage(fs_id, int(group)) is not None
        assert btrfs.qgroup_usage(fs_id, int(group))[1] == 20 * MIB  # type: ignore[index]
        assert provision_user(config, "a@x.io", (1234, 5678)) == done  # again: nothing new
        big = provision_user(config, "big@x.io", (0, 0))["data"].split(":")[2]
        assert btrfs.qgroup_usage(fs_id, int(big))[1] == 40 * MIB  # type: ignore[index]
        assert provision_user(config, "old@x.io", (0, 0))["data"].startswith("hard:")  # converted (convert.py)
        assert os.stat(data / "old@x.io").st_ino == btrfs.SUBVOLUME_ROOT_INO
        # The kernel holds the limit for data and mail together.
        with open(user / "f", "wb") as first:
            first.write(b"x" * 12 * MIB)
            os.fsync(first.fileno())
        with pytest.raises(OSError) as full, open(mail / "g", "wb") as second:
            for _ in range(12):
                second.write(b"y" * MIB)
                second.flush()
                os.fsync(second.fileno())
        assert full.value.errno == 122  # EDQUOT
        store.provision("a@x.io")
        assert store.measure_now("a@x.io").at_bytes_limit()
        (user / "f").unlink()
        (mail / "g").unlink()
        os.sync()
        assert not store.measure_now("a@x.io").at_bytes_limit()
        subprocess.run(["btrfs", "subvolume", "delete", str(user)], check=True, capture_output=True)  # the operator
        store.provision("a@x.io")  # made again, under the quota
        assert os.stat(user).st_ino == btrfs.SUBVOLUME_ROOT_INO
        store.close()


def test_peer_credentials_are_the_kernels() -> None:
    ours, theirs = socket.socketpair()
    with ours, theirs:
        from sandboxd.storage.helper import peer

        assert peer(ours)[1:] == (ME, MY_GROUP)
        assert struct.calcsize("3i") == 12


@pytest.mark.skipif(bool(BTRFS_PROBLEM), reason=str(BTRFS_PROBLEM))
def test_a_daemon_that_is_not_root_sets_quotas_through_the_helper(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The daemon's side of the helper: it asks at start-up and at a user's first sandbox; the helper does the work."""
    import threading

    helper_socket = tmp_path / "quota.sock"
    with loop_filesystem(tmp_path / "data", "btrfs", 256) as data, \
            socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as listener:
        config = _config(data, quota_bytes="20m", helper_socket=str(helper_socket))
        listener.bind(str(helper_socket))
        listener.listen()
        asked: list[int] = []

        def helper() -> None:  # what systemd's Accept=yes does: one connection, one instance
            while True:
                try:
                    conn, _ = listener.accept()
                except OSError:
                    return
                with conn:
                    asked.append(1)
                    serve_connection(conn, daemon_uid=ME, config=config)

        threading.Thread(target=helper, daemon=True).start()
        monkeypatch.setattr(os, "geteuid", lambda: 1000)  # the daemon as the sandboxd user
        store = Storage(config)
        store.resolve()
        assert [(p.mode, "sandboxd-quota helper" in p.how) for p in store.places] == [("hard", True), ("hard", True)]
        store.provision("e@x.io")
        store.provision("e@x.io")  # once per user and run
        assert len(asked) == 2  # the check at start-up, then the user's folders
        assert os.stat(data / "e@x.io").st_ino == btrfs.SUBVOLUME_ROOT_INO
        listener.close()
        helper_socket.unlink()
        gone = Storage(config)
        gone.resolve()  # auto, and no helper answers: soft, saying why
        assert gone.places[0].mode == "soft" and "did not answer" in gone.places[0].how
        store.close()
        gone.close()


@pytest.mark.skipif(bool(BTRFS_PROBLEM), reason=str(BTRFS_PROBLEM))
def test_a_plain_folder_is_converted_with_what_it_holds_and_no_link_followed(tmp_path: Path) -> None:
    with loop_filesystem(tmp_path / "data", "btrfs", 256) as data:
        config = _config(data, quota_bytes="20m", enforcement="hard")
        plain = data / "p@x.io"
        (plain / "tools" / "t" / "deep").mkdir(parents=True)  # an operator's mkdir -p and cp -r
        (plain / "tools" / "t" / "TOOL.md").write_text("tool")
        os.chown(plain / "tools" / "t" / "TOOL.md", 2000, 3000)
        os.chmod(plain / "tools" / "t" / "TOOL.md", 0o640)
        os.utime(plain / "tools" / "t" / "TOOL.md", (1_000_000, 1_000_000))
        (plain / "sparse").write_bytes(b"")
        os.truncate(plain / "sparse", 1 << 40)  # a TiB that holds nothing: not copied as zeros
        (plain / "a").write_bytes(b"x" * 100_000)
        os.link(plain / "a", plain / "tools" / "a-again")
        os.symlink("/etc/shadow", plain / "shadow")  # planted: copied as a link, never read through
        os.symlink("/etc", plain / "etc")
        os.mkfifo(plain / "fifo")
        os.setxattr(plain / "a", "user.note", b"kept")
        os.chmod(plain, 0o700)
        done = provision_user(config, "p@x.io", (1234, 5678))
        assert done["data"].startswith("hard:")
        assert os.stat(plain).st_ino == btrfs.SUBVOLUME_ROOT_INO and os.stat(plain).st_mode & 0o707 == 0o700
        tool = os.stat(plain / "tools" / "t" / "TOOL.md")
        assert (tool.st_uid, tool.st_gid, tool.st_mode & 0o777, tool.st_mtime) == (2000, 3000, 0o640, 1_000_000)
        assert (plain / "tools" / "t" / "TOOL.md").read_text() == "tool" and (plain / "tools" / "t" / "deep").is_dir()
        assert os.stat(plain / "sparse").st_size == 1 << 40 and os.stat(plain / "sparse").st_blocks == 0
        assert os.stat(plain / "a").st_ino == os.stat(plain / "tools" / "a-again").st_ino  # still one file
        assert os.getxattr(plain / "a", "user.note") == b"kept"
        assert os.readlink(plain / "shadow") == "/etc/shadow" and os.readlink(plain / "etc") == "/etc"
        assert (plain / "fifo").is_fifo()
        assert acl_users(plain)[SANDBOX_UID] == 7 and acl_users(plain / "tools")[SANDBOX_UID] == 5  # ready for a sandbox
        assert (os.stat(plain).st_uid, os.stat(plain).st_gid) == (1234, 5678)  # the daemon's, as a folder made new
        assert os.listdir(data) == ["p@x.io"]  # the old tree is gone, no leftover
        fs_id, group = done["data"].split(":")[1:]
        os.sync()
        assert 100_000 <= btrfs.qgroup_usage(fs_id, int(group))[0] < 2 * MIB  # type: ignore[index]


@pytest.mark.skipif(bool(BTRFS_PROBLEM), reason=str(BTRFS_PROBLEM))
def test_a_plain_folder_over_the_quota_is_left_as_it_was_and_the_error_names_the_fix(tmp_path: Path) -> None:
    from sandboxd.storage.convert import ConversionFailed

    with loop_filesystem(tmp_path / "data", "btrfs", 256) as data:
        config = _config(data, quota_bytes="8m", enforcement="hard")
        plain = data / "q@x.io"
        plain.mkdir()
        (plain / "big").write_bytes(b"z" * 12 * MIB)
        with pytest.raises(ConversionFailed) as failed:
            provision_user(config, "q@x.io", (0, 0))
        assert "holds more than the user's quota" in str(failed.value) and "Delete files" in str(failed.value)
        assert os.stat(plain).st_ino != btrfs.SUBVOLUME_ROOT_INO and os.path.getsize(plain / "big") == 12 * MIB
        assert os.listdir(data) == ["q@x.io"]  # the partial copy removed
        (plain / "big").unlink()
        assert provision_user(config, "q@x.io", (0, 0))["data"].startswith("hard:")
