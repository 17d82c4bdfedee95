"""email_db's SQLite side: reads a JSON request on stdin, prints a JSON answer.

Read-only is SQLite's: the database is opened with mode=ro and PRAGMA query_only=1,
so any write fails inside SQLite whatever the statement looks like. Python's
execute() runs one statement only, so a second one cannot switch query_only off.
"""
import json
import sqlite3
import sys

TEXT_COLUMNS = ("subject", "sender", "from_address", "from_addr", "from_name", "from", "to", "recipients",
                "body", "body_text", "text", "snippet", "content")


def fail(kind, message):
    print(json.dumps({"error": kind, "message": message}))
    sys.exit(0)


def connect(path):
    try:
        # immutable=0: the file may change under us (the host syncs mail into it).
        conn = sqlite3.connect(f"file:{path}?mode=ro", uri=True, timeout=5)
        conn.execute("PRAGMA query_only=1")
        conn.execute("SELECT count(*) FROM sqlite_master").fetchone()
    except sqlite3.DatabaseError as exc:
        fail("open", f"{exc}")
    return conn


def qident(name):
    return '"' + name.replace('"', '""') + '"'


def tables(conn):
    return [r[0] for r in conn.execute(
        "SELECT name FROM sqlite_master WHERE type='table' AND name NOT LIKE 'sqlite_%' ORDER BY name")]


def columns(conn, table):
    return [r[1] for r in conn.execute(f"PRAGMA table_info({qident(table)})")]


def rows_of(cursor, limit):
    names = [d[0] for d in cursor.description or []]
    got = cursor.fetchmany(limit + 1)
    truncated = len(got) > limit
    rows = [dict(zip(names, [v.hex() if isinstance(v, bytes) else v for v in r])) for r in got[:limit]]
    return {"columns": names, "rows": rows, "truncated": truncated}


def main():
    req = json.load(sys.stdin)
    conn = connect(req["db"])
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
    except sqlite3.Error as exc:
        fail("sql", str(exc))


main()
