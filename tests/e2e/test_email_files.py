"""The email database is the host's own SQLite files (issue 26, part 1). Real daemon, real Docker, real SQLite.

The host side is this test acting as the mail sync the way docs/install.md asks (the
database made 0660 before SQLite opens it, never through a link), with Python's sqlite3.
Inside the sandbox: the seed email_db tool, and `sqlite_script`, a tool that runs a
Python sqlite3 script as the sandbox uid. Each test failed while the sandbox mounted the
database file alone, over a tmpfs at /officer/data for SQLite's side files.
"""

from __future__ import annotations

import hashlib
import os
import sqlite3
import stat
from pathlib import Path
from typing import Any

import pytest

from sandboxd.client import Client

from tests.e2e.conftest import PYTHON_SCRIPT_TOOL, Daemon, write_tool
from tests.e2e.hostile_harness import wait_until
from tests.e2e.results import ok, refused, text

pytestmark = pytest.mark.docker

A = "alice@example.com"
# One sandbox per user, so that "while warm" means the same sandbox (its hostname shows it).
ONE_SANDBOX = "pool:\n  max_per_user: 1\n"

OPEN = "import os, sqlite3, time\ndb = sqlite3.connect(os.environ['OFFICER_EMAIL_DB'], isolation_level=None, timeout=10)\n"


# The hostname of the sandbox a tool declaring `email: read` runs in: email_db's own (a sandbox carries one email access).
READ_HOST_TOOL = "import { hostname } from 'node:os';\nexport async function execute() { return { content: [{ type: 'text', text: hostname() }] }; }\n"


def started(make_daemon: Any, config: str = ONE_SANDBOX) -> Daemon:
    daemon = make_daemon(config, start=False)
    write_tool(daemon.data / "tools", "sqlite_script", PYTHON_SCRIPT_TOOL,
               inputs="  script:\n    type: string\n    description: Python to run.\n")
    read_host = write_tool(daemon.data / "tools", "read_host", READ_HOST_TOOL)
    manifest = read_host / "TOOL.md"
    manifest.write_text(manifest.read_text().replace("version: 1\n", "version: 1\npermissions:\n  email: read\n", 1))
    return daemon.start()


def mail_path(daemon: Daemon, user: str = A) -> Path:
    return daemon.data / "email" / user / "emails.db"


def sync_open(db: Path) -> sqlite3.Connection:
    """The host's mail sync, as docs/install.md asks: the file made 0660 (so SQLite gives its
    -journal, -wal and -shm that mode too), and opened only when it and its companions are
    regular files (or absent): a tool may have planted links there."""
    db.parent.mkdir(parents=True, exist_ok=True)
    try:
        os.close(os.open(db, os.O_CREAT | os.O_EXCL | os.O_WRONLY | os.O_NOFOLLOW, 0o660))
    except FileExistsError:
        pass
    for suffix in ("", "-journal", "-wal", "-shm"):
        try:
            info = os.lstat(f"{db}{suffix}")
        except FileNotFoundError:
            continue
        assert stat.S_ISREG(info.st_mode) and info.st_nlink == 1, f"{db}{suffix} is not a plain file"
    return sqlite3.connect(db, isolation_level=None)


def add_messages(db: sqlite3.Connection, *subjects: str) -> None:
    db.executemany("INSERT INTO messages (subject) VALUES (?)", [(s,) for s in subjects])


def sandbox_sql(client: Client, script: str, user: str = A) -> str:
    return ok(client.call_tool(user, "sqlite_script", {"script": OPEN + script}))


def sandbox_host(client: Client, user: str = A) -> str:
    """The hostname of the sandbox serving the user's `email: read` tools (email_db's): its container.
    (Opens no database: that would make one.)"""
    return ok(client.call_tool(user, "read_host", {}))


def writer_host(client: Client, user: str = A) -> str:
    """The hostname of the sandbox serving sqlite_script, a tool without a permissions block (email read-write)."""
    return ok(client.call_tool(user, "sqlite_script", {"script": "import socket; print(socket.gethostname())"}))


def count_in_sandbox(client: Client) -> str:
    return ok(client.call_tool(A, "email_db", {"action": "query", "sql": "SELECT count(*) AS n FROM messages"}))


def test_a_wal_database_is_read_with_the_frames_not_yet_checkpointed(make_daemon: Any) -> None:
    daemon = started(make_daemon)
    db = mail_path(daemon)
    sync = sync_open(db)
    sync.execute("PRAGMA journal_mode=WAL")
    sync.execute("PRAGMA wal_autocheckpoint=0")  # every frame stays in -wal while the sync runs
    sync.execute("CREATE TABLE messages (id INTEGER PRIMARY KEY, subject TEXT)")
    add_messages(sync, "one", "two", "three", "four", "five")
    # The database file alone holds none of it yet: the table and rows are in -wal.
    alone = sqlite3.connect(f"file:{db}?immutable=1", uri=True)
    with pytest.raises(sqlite3.OperationalError, match="no such table"):
        alone.execute("SELECT count(*) FROM messages")
    alone.close()
    with daemon.client() as client:
        assert "messages: 5 rows" in ok(client.call_tool(A, "email_db", {"action": "stats"}))
        # A writer in the sandbox beside the sync's open connection: one WAL index, shared.
        assert sandbox_sql(client, "db.execute(\"INSERT INTO messages (subject) VALUES ('from the sandbox')\")\n"
                                   "print(db.execute('SELECT count(*) FROM messages').fetchone()[0])") == "6"
        assert sync.execute("SELECT subject FROM messages WHERE id = 6").fetchone() == ("from the sandbox",)
        add_messages(sync, "seven")
        assert "1. n: 7" in count_in_sandbox(client)
    assert sync.execute("PRAGMA integrity_check").fetchone() == ("ok",)
    sync.close()


def test_rows_the_sync_adds_while_a_sandbox_is_warm_are_seen_at_its_next_query(make_daemon: Any) -> None:
    daemon = started(make_daemon)
    sync = sync_open(mail_path(daemon))
    sync.execute("PRAGMA journal_mode=WAL")
    sync.execute("PRAGMA wal_autocheckpoint=0")
    sync.execute("CREATE TABLE messages (id INTEGER PRIMARY KEY, subject TEXT)")
    add_messages(sync, "one", "two", "three")
    sync.execute("PRAGMA wal_checkpoint(TRUNCATE)")  # these three are in the database file itself
    with daemon.client() as client:
        warm = sandbox_host(client)
        assert "1. n: 3" in count_in_sandbox(client)
        add_messages(sync, "four", "five")  # in -wal only, as a sync that keeps its connection leaves them
        assert "1. n: 5" in count_in_sandbox(client)
        add_messages(sync, "six")
        assert "1. n: 6" in count_in_sandbox(client)
        assert sandbox_host(client) == warm  # the same sandbox all along
    sync.close()


def test_a_database_made_after_the_sandbox_started_is_seen_at_its_next_call(make_daemon: Any) -> None:
    daemon = started(make_daemon)
    with daemon.client() as client:
        warm = sandbox_host(client)
        refused(client.call_tool(A, "email_db", {"action": "stats"}), "No email database at /officer/data/emails.db")
        sync = sync_open(mail_path(daemon))  # the user connects their mailbox mid-session
        sync.execute("CREATE TABLE messages (id INTEGER PRIMARY KEY, subject TEXT)")
        add_messages(sync, "hello", "again")
        assert "messages: 2 rows" in ok(client.call_tool(A, "email_db", {"action": "stats"}))
        assert sandbox_host(client) == warm  # the sandbox that started before the database was made
        # ... and the sandbox uid may write it (the folder's default ACL, the file's mode 0660).
        assert sandbox_sql(client, "db.execute(\"INSERT INTO messages (subject) VALUES ('reply')\")\n"
                                   "print('written')") == "written"
    assert sync.execute("SELECT count(*) FROM messages").fetchone() == (3,)
    sync.close()


def digest(db: Path) -> str:
    with sqlite3.connect(db) as check:  # a read-write open: it rolls back a hot journal it finds
        rows = check.execute("SELECT id, body FROM messages ORDER BY id").fetchall()
    check.close()
    return hashlib.sha256(repr(rows).encode()).hexdigest()


def test_a_write_killed_half_way_is_rolled_back_by_the_next_opener(make_daemon: Any, docker_api: Any) -> None:
    daemon = started(make_daemon)
    db = mail_path(daemon)
    sync = sync_open(db)  # rollback-journal mode, SQLite's default
    sync.execute("CREATE TABLE messages (id INTEGER PRIMARY KEY, body TEXT)")
    sync.executemany("INSERT INTO messages (body) VALUES (hex(randomblob(2000)))", [()] * 400)  # about 1.6 MB
    sync.close()
    before, file_before = digest(db), db.read_bytes()
    # A cache of 5 pages: the update spills changed pages into the database file long before
    # its commit (after writing them to the journal). Then the tool waits, and its call's
    # timeout kills the sandbox, mid-transaction.
    script = ("db.execute('PRAGMA cache_size=5')\ndb.execute('BEGIN')\n"
              "db.execute('UPDATE messages SET body = lower(body)')\nprint('spilled', flush=True)\ntime.sleep(3600)\n")
    with daemon.client() as client:
        doomed = writer_host(client)
        result = client.call_tool(A, "sqlite_script", {"script": OPEN + script}, timeoutMs=6000)
    assert result["status"] == "timeout", result
    wait_until(lambda: not any(c["Id"].startswith(doomed) for c in daemon.containers(docker_api)), 30,
               "the killed sandbox to be removed")
    assert db.read_bytes() != file_before, "the update never reached the database file: nothing to roll back"
    journal = Path(f"{db}-journal")
    hot = journal.is_file() and journal.stat().st_size > 0
    assert digest(db) == before, "the database was left half-updated"  # this opener rolled it back ...
    assert hot and not journal.exists()  # ... from the journal the sandbox wrote beside it
    with sqlite3.connect(db) as check:
        assert check.execute("PRAGMA integrity_check").fetchone() == ("ok",)
    check.close()


def test_email_db_names_a_hot_journal_instead_of_a_bare_sqlite_error(make_daemon: Any) -> None:
    """A read-only open cannot roll a killed write back; the tool says what happened and what mends it."""
    daemon = started(make_daemon, config="")
    db = mail_path(daemon)
    sync = sync_open(db)
    sync.execute("CREATE TABLE messages (id INTEGER PRIMARY KEY, body TEXT)")
    sync.executemany("INSERT INTO messages (body) VALUES (hex(randomblob(2000)))", [()] * 100)
    sync.close()
    script = ("db.execute('PRAGMA cache_size=5')\ndb.execute('BEGIN')\n"
              "db.execute('UPDATE messages SET body = lower(body)')\nos._exit(9)\n")  # dies, journal left hot
    with daemon.client() as client:
        result = client.call_tool(A, "sqlite_script", {"script": OPEN + script})
        assert result["isError"] is True, text(result)
        message = refused(client.call_tool(A, "email_db", {"action": "stats"}), "unfinished write", "rolls it back")
        assert "attempt to write a readonly database" not in message
        sync = sync_open(db)  # the sync's next open rolls it back
        sync.execute("SELECT count(*) FROM messages").fetchone()
        sync.close()
        assert "messages: 100 rows" in ok(client.call_tool(A, "email_db", {"action": "stats"}))
