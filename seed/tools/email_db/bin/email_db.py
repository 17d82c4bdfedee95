"""email_db's SQLite side: reads a JSON request on stdin, prints a JSON answer.

Only reads run, each within a budget, and SQLite itself holds both:
- the database is opened read-only (mode=ro) with PRAGMA query_only=1;
- an authorizer lets through, at prepare time, only what reads: SELECT (WITH ... SELECT,
  recursive CTEs included), reading tables and columns, functions but load_extension,
  and PRAGMAs that only report. Every write, transaction, ATTACH (VACUUM and VACUUM INTO
  attach a database too) and any other statement is refused, by name;
- no database can be attached (SQLITE_LIMIT_ATTACHED 0), whatever the authorizer says;
- a progress handler stops the statement running once the request's time budget is spent
  (a recursive CTE without an end, the mailbox joined with itself);
- at most `limit` rows and MAX_VALUE_BYTES of values come back, and SQLite's heap is
  capped, so a query that builds huge values fails with "out of memory" instead of
  taking the sandbox's memory.
Python's execute() runs one statement only, so a second one never runs.
"""
import json
import os
import sqlite3
import sys
import time

TEXT_COLUMNS = ("subject", "sender", "from_address", "from_addr", "from_name", "from", "to", "recipients",
                "body", "body_text", "text", "snippet", "content")
HEAP_BYTES = 64 << 20
MAX_VALUE_BYTES = 16 << 20  # of the values in one answer (strings, blobs as hex)
PROGRESS_STEPS = 10_000  # SQLite VM steps between two looks at the clock (well under a millisecond)

# PRAGMAs that only report; those in NAMED may take a table or index name (or a number) too.
# Any other PRAGMA, and any of these given a value (PRAGMA user_version = 7), is refused.
REPORTING_PRAGMAS = {"table_info", "table_xinfo", "table_list", "index_list", "index_info", "index_xinfo",
                     "foreign_key_list", "foreign_key_check", "integrity_check", "quick_check", "collation_list",
                     "function_list", "module_list", "pragma_list", "database_list", "compile_options",
                     "user_version", "application_id", "schema_version", "data_version", "page_count", "page_size",
                     "freelist_count", "encoding", "journal_mode", "auto_vacuum", "query_only"}
NAMED_PRAGMAS = {"table_info", "table_xinfo", "table_list", "index_list", "index_info", "index_xinfo",
                 "foreign_key_list", "foreign_key_check", "integrity_check", "quick_check"}
ACTION_WORDS = {
    sqlite3.SQLITE_INSERT: "INSERT", sqlite3.SQLITE_UPDATE: "UPDATE", sqlite3.SQLITE_DELETE: "DELETE",
    sqlite3.SQLITE_ATTACH: "ATTACH (VACUUM and VACUUM INTO attach a database too)",
    sqlite3.SQLITE_DETACH: "DETACH", sqlite3.SQLITE_TRANSACTION: "a transaction (BEGIN, COMMIT)",
    sqlite3.SQLITE_SAVEPOINT: "SAVEPOINT", sqlite3.SQLITE_ALTER_TABLE: "ALTER TABLE", sqlite3.SQLITE_REINDEX: "REINDEX",
    sqlite3.SQLITE_ANALYZE: "ANALYZE", sqlite3.SQLITE_DROP_TABLE: "DROP TABLE", sqlite3.SQLITE_DROP_INDEX: "DROP INDEX",
    sqlite3.SQLITE_DROP_VIEW: "DROP VIEW", sqlite3.SQLITE_DROP_TRIGGER: "DROP TRIGGER",
    sqlite3.SQLITE_CREATE_TABLE: "CREATE TABLE", sqlite3.SQLITE_CREATE_INDEX: "CREATE INDEX",
    sqlite3.SQLITE_CREATE_VIEW: "CREATE VIEW", sqlite3.SQLITE_CREATE_TRIGGER: "CREATE TRIGGER",
    sqlite3.SQLITE_CREATE_TEMP_TABLE: "CREATE TEMP TABLE", sqlite3.SQLITE_CREATE_TEMP_VIEW: "CREATE TEMP VIEW",
    sqlite3.SQLITE_CREATE_TEMP_INDEX: "CREATE TEMP INDEX", sqlite3.SQLITE_CREATE_TEMP_TRIGGER: "CREATE TEMP TRIGGER",
    sqlite3.SQLITE_CREATE_VTABLE: "CREATE VIRTUAL TABLE", sqlite3.SQLITE_DROP_VTABLE: "DROP VIRTUAL TABLE",
}
# A read-only open cannot repair what a killed writer left; a read-write open (the mail sync's next) does.
UNFINISHED = {
    sqlite3.SQLITE_READONLY_ROLLBACK: "the database has an unfinished write (a hot journal, left by a writer that "
                                      "was killed mid-transaction); a read-write open rolls it back",
    sqlite3.SQLITE_READONLY_RECOVERY: "the database's WAL index needs recovery after a writer was killed; "
                                      "a read-write open recovers it",
}


def fail(kind, message):
    print(json.dumps({"error": kind, "message": message}))
    sys.exit(0)


class Guard:
    """The authorizer and the time budget of one request, and what they last refused."""

    def __init__(self, budget_s):
        self.budget_s = budget_s
        self.deadline = time.monotonic() + budget_s
        self.refused = None

    def authorize(self, action, arg1, arg2, db, _trigger):
        if action in (sqlite3.SQLITE_SELECT, sqlite3.SQLITE_READ, sqlite3.SQLITE_RECURSIVE):
            return sqlite3.SQLITE_OK
        if action == sqlite3.SQLITE_FUNCTION and (arg2 or "").lower() != "load_extension":
            return sqlite3.SQLITE_OK
        if action == sqlite3.SQLITE_UPDATE and arg1 == "sqlite_master" and db == "main":
            # SQLite's own table-valued functions (json_each, pragma_table_info) ask for this the first
            # time a connection uses one. A real UPDATE of the schema also needs writable_schema (a
            # PRAGMA refused below) and fails on the read-only open regardless.
            return sqlite3.SQLITE_OK
        name = (arg1 or "").lower()
        if action == sqlite3.SQLITE_PRAGMA and name in REPORTING_PRAGMAS and (arg2 is None or name in NAMED_PRAGMAS):
            return sqlite3.SQLITE_OK
        if action == sqlite3.SQLITE_PRAGMA:
            self.refused = f"PRAGMA {arg1}" + (f" = {arg2}" if arg2 is not None else "")
        elif action == sqlite3.SQLITE_FUNCTION:
            self.refused = f"{arg2}()"
        else:
            self.refused = ACTION_WORDS.get(action, "this statement")
        return sqlite3.SQLITE_DENY

    def progress(self):
        return time.monotonic() > self.deadline  # true: SQLite interrupts the statement

    def explain(self, exc):
        """The message for an SQLite error, naming what a refusal or a budget stopped."""
        text = "out of memory" if isinstance(exc, MemoryError) else str(exc)
        if (text.startswith("not authorized") or text == "authorization denied") and self.refused is not None:
            return (f"{self.refused} is refused: email_db runs read-only statements only (SELECT, WITH ... SELECT, "
                    "PRAGMAs that report), and attaches nothing")
        if text == "interrupted":
            return (f"the query ran longer than its time budget of {self.budget_s:g} s and was stopped; narrow it "
                    "(WHERE, LIMIT; a recursive CTE needs an end condition) or raise timeout_seconds")
        if text == "out of memory":
            return (f"the query needed more than {HEAP_BYTES >> 20} MiB of memory and was stopped; "
                    "select fewer or smaller values")
        if "too many attached databases" in text:
            return "ATTACH is refused: email_db attaches nothing (VACUUM and VACUUM INTO attach a database too)"
        return text


def open_read_only(uri):
    conn = sqlite3.connect(uri, uri=True, timeout=5)
    conn.execute("PRAGMA query_only=1")
    conn.execute(f"PRAGMA hard_heap_limit={HEAP_BYTES}")
    conn.execute("SELECT count(*) FROM sqlite_master").fetchone()
    return conn


def open_mailbox(path):
    """Read-only, and not immutable: the host syncs mail into it meanwhile. But on a folder mounted
    read-only (permissions.email: read), SQLite cannot make a WAL database's -wal and -shm; with
    no -wal there the mail sync has no connection open, and the file itself holds every commit."""
    try:
        return open_read_only(f"file:{path}?mode=ro")
    except sqlite3.OperationalError as exc:
        if getattr(exc, "sqlite_errorcode", None) != sqlite3.SQLITE_CANTOPEN or os.path.exists(f"{path}-wal"):
            raise
    return open_read_only(f"file:{path}?mode=ro&immutable=1")


def connect(path, guard):
    try:
        conn = open_mailbox(path)
    except sqlite3.DatabaseError as exc:
        unfinished = UNFINISHED.get(getattr(exc, "sqlite_errorcode", None))
        if unfinished is not None:
            fail("unfinished", unfinished)
        fail("open", f"{exc}")
    conn.setlimit(sqlite3.SQLITE_LIMIT_ATTACHED, 0)
    conn.set_authorizer(guard.authorize)
    conn.set_progress_handler(guard.progress, PROGRESS_STEPS)
    return conn


def qident(name):
    return '"' + name.replace('"', '""') + '"'


def tables(conn):
    return [r[0] for r in conn.execute(
        "SELECT name FROM sqlite_master WHERE type='table' AND name NOT LIKE 'sqlite_%' ORDER BY name")]


def columns(conn, table):
    return [r[1] for r in conn.execute(f"PRAGMA table_info({qident(table)})")]


def size_of(v):
    return 2 * len(v) if isinstance(v, bytes) else len(v) if isinstance(v, str) else 0  # blobs go out as hex


def rows_of(cursor, limit):
    """At most ``limit`` rows and MAX_VALUE_BYTES of their values; SQLite steps no further."""
    names = [d[0] for d in cursor.description or []]
    rows, size, truncated, too_big = [], 0, False, False
    for row in cursor:
        if len(rows) == limit:
            truncated = True
            break
        size += sum(size_of(v) for v in row)
        if size > MAX_VALUE_BYTES:
            truncated = too_big = True
            break
        rows.append(dict(zip(names, [v.hex() if isinstance(v, bytes) else v for v in row])))
    answer = {"columns": names, "rows": rows, "truncated": truncated}
    if too_big:
        answer["cut"] = f"the rows after these hold more than {MAX_VALUE_BYTES >> 20} MiB of values"
    return answer


def main():
    req = json.load(sys.stdin)
    guard = Guard(float(req.get("budget_s") or 20))
    conn = connect(req["db"], guard)
    action = req["action"]
    limit = int(req.get("limit") or 50)
    try:
        if action == "stats":
            out = [{"table": t, "rows": conn.execute(f"SELECT count(*) FROM {qident(t)}").fetchone()[0]}
                   for t in tables(conn)]
            print(json.dumps({"tables": out}))
        elif action == "schema":
            out = [{"name": n, "type": k, "sql": s} for n, k, s in conn.execute(
                "SELECT name, type, sql FROM sqlite_master WHERE sql IS NOT NULL AND name NOT LIKE 'sqlite_%'"
                " ORDER BY type DESC, name")]
            print(json.dumps({"objects": out}))
        elif action == "query":
            print(json.dumps(rows_of(conn.execute(req["sql"]), limit)))
        elif action == "search":
            text = req["text"]
            found = []
            searched = []
            for t in tables(conn):
                cols = [c for c in columns(conn, t) if c.lower() in TEXT_COLUMNS]
                if not cols:
                    continue
                searched.append({"table": t, "columns": cols})
                where = " OR ".join(f"{qident(c)} LIKE ? ESCAPE '\\'" for c in cols)
                pattern = "%" + text.replace("\\", "\\\\").replace("%", "\\%").replace("_", "\\_") + "%"
                cur = conn.execute(f"SELECT * FROM {qident(t)} WHERE {where}", [pattern] * len(cols))
                found.append({"table": t, **rows_of(cur, limit)})
            print(json.dumps({"searched": searched, "results": found}))
        else:
            fail("action", f"unknown action {action!r}")
    except (sqlite3.Error, MemoryError) as exc:  # SQLite's "out of memory" (its heap limit) is a MemoryError
        fail("sql", guard.explain(exc))


main()
