"""Hard enforcement on a btrfs loop filesystem: a conversion with only the helper's capabilities, and files bounded
by the byte quota (issue 44, items 1 and 8)."""

from __future__ import annotations

import errno
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from sandboxd.config import load_config
from sandboxd.storage import btrfs
from sandboxd.storage.provision import provision_user

from tests.loopfs import MIB, loop_devices_usable, loop_filesystem

BTRFS_PROBLEM = loop_devices_usable("btrfs")
pytestmark = pytest.mark.skipif(bool(BTRFS_PROBLEM), reason=str(BTRFS_PROBLEM))
SANDBOX_UID = 2_000_000_000
# packaging/systemd/sandboxd-quota@.service: CapabilityBoundingSet=
HELPER_CAPABILITIES = "-all,+sys_admin,+chown,+dac_override"

PROVISION = """
import sys
from sandboxd.config import load_config
from sandboxd.storage.provision import provision_user
config = load_config(environ={}, overrides={"data_path": sys.argv[1], "storage": {"enforcement": "hard"}})
print(provision_user(config, sys.argv[2], (1000, 1000)))
"""


@pytest.mark.skipif(shutil.which("setpriv") is None, reason="needs setpriv (util-linux)")
def test_the_helper_converts_a_folder_of_the_sandbox_uids_private_files_with_its_three_capabilities(
        tmp_path: Path) -> None:
    with loop_filesystem(tmp_path / "data", "btrfs", 256) as data:
        (data / "email").mkdir()
        user = data / "h@x.io"
        (user / "private" / "deeper").mkdir(parents=True)  # what a sandbox made: its uid's, closed to others
        (user / "private" / "deeper" / "secret").write_text("the tool's")
        for path, mode in ((user / "private" / "deeper" / "secret", 0o600), (user / "private" / "deeper", 0o700),
                           (user / "private", 0o1700)):  # sticky too
            os.chown(path, SANDBOX_UID, SANDBOX_UID)
            os.chmod(path, mode)
        os.chown(user, 1000, 1000)
        ran = subprocess.run(["setpriv", "--bounding-set", HELPER_CAPABILITIES, "--inh-caps", "-all",
                              sys.executable, "-c", PROVISION, str(data), "h@x.io"],
                             capture_output=True, text=True, cwd=Path(__file__).parents[2], check=False)
        assert ran.returncode == 0 and "'data': 'hard:" in ran.stdout, ran.stderr
        assert os.stat(user).st_ino == btrfs.SUBVOLUME_ROOT_INO and os.stat(user).st_uid == 1000
        secret = user / "private" / "deeper" / "secret"
        assert secret.read_text() == "the tool's" and os.stat(secret).st_uid == SANDBOX_UID
        assert os.stat(user / "private").st_mode & 0o7777 == 0o1700
        assert sorted(os.listdir(data)) == ["email", "h@x.io"]  # the old tree removed


def test_files_are_bounded_by_the_byte_quota_through_their_metadata(tmp_path: Path) -> None:
    """btrfs has no file count limit; the qgroup counts each file's metadata, so empty files stop too."""
    with loop_filesystem(tmp_path / "data", "btrfs", 256) as data:
        config = load_config(environ={}, overrides={"data_path": data, "storage": {"quota_bytes": "4m"}})
        assert provision_user(config, "many@x.io", (0, 0))["data"].startswith("hard:")
        made, stopped = 0, None
        while made < 1_000_000:
            try:
                os.close(os.open(data / "many@x.io" / str(made), os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600))
            except OSError as exc:
                stopped = exc.errno
                break
            made += 1
        assert stopped == errno.EDQUOT
        # 186,136 empty files in 64 MiB measured (docs/config.md): about 360 bytes of metadata each.
        assert 4 * MIB // 1024 <= made <= 4 * MIB // 256, made


def test_a_folder_an_operator_replaces_by_a_plain_one_while_the_daemon_runs_is_converted_at_the_next_sandbox(
        tmp_path: Path) -> None:
    from sandboxd.storage.quota import Storage

    with loop_filesystem(tmp_path / "data", "btrfs", 256) as data:
        store = Storage(load_config(environ={}, overrides={"data_path": data, "storage": {"enforcement": "hard"}}))
        store.resolve()
        store.provision("r@x.io")
        user = data / "r@x.io"
        assert os.stat(user).st_ino == btrfs.SUBVOLUME_ROOT_INO
        subprocess.run(["btrfs", "subvolume", "delete", str(user)], check=True, capture_output=True)
        (user / "tools" / "mine").mkdir(parents=True)  # the operator's mkdir -p and a copied tool
        (user / "tools" / "mine" / "TOOL.md").write_text("mine")
        store.provision("r@x.io")  # the next sandbox's start
        assert os.stat(user).st_ino == btrfs.SUBVOLUME_ROOT_INO
        assert (user / "tools" / "mine" / "TOOL.md").read_text() == "mine"
        store.close()


def test_one_users_conversion_holds_up_no_other_users_provisioning(tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    import threading

    from sandboxd.storage import convert, quota

    with loop_filesystem(tmp_path / "data", "btrfs", 256) as data:
        store = quota.Storage(load_config(environ={}, overrides={"data_path": data,
                                                                 "storage": {"enforcement": "hard"}}))
        store.resolve()
        (data / "slow@x.io").mkdir()
        copying, release = threading.Event(), threading.Event()
        real = convert._copy_folder

        def slow_copy(*args: object) -> None:
            copying.set()
            release.wait(30)
            real(*args)  # type: ignore[arg-type]

        monkeypatch.setattr(convert, "_copy_folder", slow_copy)
        slow = threading.Thread(target=store.provision, args=("slow@x.io",))
        slow.start()
        assert copying.wait(10)
        other = threading.Thread(target=store.provision, args=("quick@x.io",))
        other.start()
        other.join(10)
        done_meanwhile = not other.is_alive()
        release.set()
        slow.join(30)
        assert done_meanwhile, "another user's first sandbox waited for one user's conversion"
        assert os.stat(data / "slow@x.io").st_ino == btrfs.SUBVOLUME_ROOT_INO
        store.close()


def test_an_entry_swapped_for_a_link_during_the_copy_is_left_out_never_followed(tmp_path: Path) -> None:
    """What a sandbox racing the copy can do: a folder listed as one, a link by the time it is opened."""
    from sandboxd.storage import convert

    src, dst = tmp_path / "src", tmp_path / "dst"
    src.mkdir()
    dst.mkdir()
    (tmp_path / "outside").mkdir()
    (tmp_path / "outside" / "secret").write_text("not the user's")
    listed_as_folder = os.stat(tmp_path / "outside")
    os.symlink(tmp_path / "outside", src / "d")  # swapped in after the listing
    (src / "f").mkdir()
    listed_as_file = os.stat(tmp_path / "outside" / "secret")
    src_fd, dst_fd = os.open(src, os.O_RDONLY), os.open(dst, os.O_RDONLY)
    try:
        copy = convert._Copy(dst_fd)
        convert._copy_entry(src_fd, dst_fd, "d", listed_as_folder, "d", copy, 0)
        convert._copy_entry(src_fd, dst_fd, "f", listed_as_file, "f", copy, 0)  # a file then, a folder now
    finally:
        os.close(src_fd)
        os.close(dst_fd)
    assert os.listdir(dst) == []
