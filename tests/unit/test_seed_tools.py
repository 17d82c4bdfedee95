"""The seed tools without Docker: manifests, imports, and email_db's SQLite helper on the host.

tests/e2e/test_seed_tools.py runs the same tools in real sandboxes.
"""

from __future__ import annotations

import json
import re
import sqlite3
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[2]
SEED = REPO / "seed" / "tools"
TOOLS = sorted(p.name for p in SEED.iterdir() if (p / "TOOL.md").is_file())
HELPER = SEED / "email_db" / "bin" / "email_db.py"


def test_the_seed_holds_the_platform_tools_and_validates_clean() -> None:
    assert {"email_db", "ffmpeg", "convert_audio_to_mp3", "ocr", "web_fetch", "web_search"} <= set(TOOLS)
    run = subprocess.run([sys.executable, "-m", "sandboxd", "validate", str(SEED)], capture_output=True, text=True,
                         cwd=REPO)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "0 errors, 0 warnings" in run.stdout + run.stderr, run.stdout + run.stderr


@pytest.mark.parametrize("tool", TOOLS)
def test_a_seed_tool_uses_only_the_node_standard_library(tool: str) -> None:
    source = (SEED / tool / "index.ts").read_text()
    modules = re.findall(r"""(?:from|require\()\s*['"]([^'"]+)['"]""", source)
    assert all(m.startswith("node:") for m in modules), modules


@pytest.mark.parametrize("tool", [t for t in TOOLS if t != "hello"])
def test_a_seed_tool_documents_examples_and_errors_for_the_agent(tool: str) -> None:
    body = (SEED / tool / "TOOL.md").read_text().split("\n---\n", 1)[1]
    assert "## Examples" in body and "## Errors" in body


def helper(db: Path, **request: Any) -> dict[str, Any]:
    run = subprocess.run([sys.executable, str(HELPER)], input=json.dumps({"db": str(db), **request}),
                         capture_output=True, text=True, timeout=30)
    assert run.returncode == 0, run.stderr
    return json.loads(run.stdout)


@pytest.fixture
def mail(tmp_path: Path) -> Path:
    db = tmp_path / "emails.db"
    with sqlite3.connect(db) as conn:
        conn.execute("CREATE TABLE messages (id INTEGER PRIMARY KEY, subject TEXT, sender TEXT, body TEXT)")
        conn.execute("CREATE INDEX by_sender ON messages (sender)")
        conn.executemany("INSERT INTO messages (subject, sender, body) VALUES (?, ?, ?)",
                         [("a_b", "x@example.com", "50% off"), ("ab", "y@example.com", "nothing")])
    conn.close()
    return db


@pytest.mark.parametrize("sql", [
    "DELETE FROM messages",
    "WITH t AS (SELECT 1) DELETE FROM messages",
    "WITH t AS (SELECT 1) INSERT INTO messages (subject) SELECT 'x' FROM t",
    "REPLACE INTO messages (id, subject) VALUES (1, 'x')",
    "UPDATE messages SET body = ''",
    "DROP TABLE messages",
    "CREATE TABLE planted (x)",
    "CREATE TEMP TABLE planted (x)",
    "ALTER TABLE messages ADD COLUMN planted",
    "PRAGMA user_version = 3",
    "VACUUM",
    "REINDEX",
])
def test_email_db_helper_refuses_every_write_before_it_runs(mail: Path, sql: str) -> None:
    before = mail.read_bytes()
    answer = helper(mail, action="query", sql=sql, limit=10)
    assert answer["error"] == "sql", answer
    assert "is refused: email_db runs read-only statements only" in answer["message"], answer
    assert mail.read_bytes() == before


@pytest.mark.parametrize(("sql", "named"), [
    ("ATTACH '{dir}/planted.db' AS p", "ATTACH"),
    ("VACUUM INTO '{dir}/copy.db'", "ATTACH (VACUUM and VACUUM INTO attach a database too)"),
    ("PRAGMA query_only = 0", "PRAGMA query_only = 0"),
    ("PRAGMA writable_schema = 1", "PRAGMA writable_schema = 1"),
    ("BEGIN IMMEDIATE", "a transaction"),
    ("SELECT load_extension('/tmp/x')", "load_extension()"),
])
def test_email_db_helper_names_what_it_refused_and_makes_no_file(mail: Path, sql: str, named: str) -> None:
    answer = helper(mail, action="query", sql=sql.format(dir=mail.parent), limit=10)
    assert answer["error"] == "sql" and answer["message"].startswith(named), answer
    assert sorted(p.name for p in mail.parent.iterdir()) == ["emails.db"]


def test_email_db_helper_allows_reporting_pragmas_and_table_valued_functions(mail: Path) -> None:
    assert helper(mail, action="query", sql="PRAGMA user_version", limit=5)["rows"] == [{"user_version": 0}]
    names = helper(mail, action="query", sql="SELECT name FROM pragma_table_info('messages')", limit=10)["rows"]
    assert [r["name"] for r in names] == ["id", "subject", "sender", "body"]
    assert helper(mail, action="query", sql="SELECT value FROM json_each('[1, 2]')", limit=5)["rows"] == [
        {"value": 1}, {"value": 2}]
    cte = "WITH RECURSIVE r(i) AS (SELECT 1 UNION ALL SELECT i + 1 FROM r WHERE i < 5) SELECT sum(i) AS s FROM r"
    assert helper(mail, action="query", sql=cte, limit=5)["rows"] == [{"s": 15}]


def test_email_db_helper_stops_an_endless_query_at_its_time_budget(mail: Path) -> None:
    started = time.monotonic()
    answer = helper(mail, action="query", limit=5, budget_s=1,
                    sql="WITH RECURSIVE r(i) AS (SELECT 1 UNION ALL SELECT i + 1 FROM r) SELECT count(*) FROM r")
    assert time.monotonic() - started < 5
    assert answer["error"] == "sql" and "longer than its time budget of 1 s" in answer["message"], answer


def test_email_db_helper_bounds_memory_and_the_values_it_returns(mail: Path) -> None:
    doubling = "WITH RECURSIVE r(x) AS (SELECT 'a' UNION ALL SELECT x || x FROM r) SELECT length(x) FROM r LIMIT 40"
    answer = helper(mail, action="query", sql=doubling, limit=50)
    assert answer["error"] == "sql" and "needed more than 64 MiB of memory" in answer["message"], answer
    big = helper(mail, action="query", sql="SELECT zeroblob(3000000) AS b FROM messages, messages m2", limit=50)
    assert len(big["rows"]) == 2 and big["truncated"] and "16 MiB" in big["cut"], {k: v for k, v in big.items() if k != "rows"}


def test_email_db_helper_names_an_unfinished_write_it_cannot_roll_back(mail: Path) -> None:
    script = (f"import os, sqlite3\nc = sqlite3.connect({str(mail)!r}, isolation_level=None)\n"
              "c.execute('PRAGMA cache_size=1')\nc.execute('BEGIN')\n"
              "c.executemany('INSERT INTO messages (body) VALUES (?)', [('x' * 5000,)] * 50)\nos._exit(9)\n")
    subprocess.run([sys.executable, "-c", script], check=False)
    assert Path(f"{mail}-journal").stat().st_size > 0  # left hot
    answer = helper(mail, action="stats")
    assert answer["error"] == "unfinished" and "a read-write open rolls it back" in answer["message"], answer


def test_email_db_helper_runs_one_statement_only(mail: Path) -> None:
    answer = helper(mail, action="query", sql="SELECT 1; DELETE FROM messages", limit=10)
    assert answer["error"] == "sql" and "one statement" in answer["message"], answer
    assert helper(mail, action="stats")["tables"] == [{"table": "messages", "rows": 2}]


def test_email_db_helper_queries_limits_and_searches_literally(mail: Path) -> None:
    rows = helper(mail, action="query", sql="SELECT subject FROM messages ORDER BY id", limit=1)
    assert rows == {"columns": ["subject"], "rows": [{"subject": "a_b"}], "truncated": True}
    # "_" and "%" in the text are not LIKE wildcards.
    found = helper(mail, action="search", text="a_b", limit=10)
    assert [r["subject"] for r in found["results"][0]["rows"]] == ["a_b"]
    assert [r["body"] for r in helper(mail, action="search", text="50%", limit=10)["results"][0]["rows"]] == ["50% off"]
    assert found["searched"] == [{"table": "messages", "columns": ["subject", "sender", "body"]}]


def test_email_db_helper_names_a_database_it_cannot_open(tmp_path: Path) -> None:
    junk = tmp_path / "emails.db"
    junk.write_text("not sqlite " * 100)
    answer = helper(junk, action="stats")
    assert answer["error"] == "open" and "not a database" in answer["message"], answer


USER_PATHS = re.compile(r"^// --- the user's folder, and paths confined to it.*?^// --- end of the user's folder$",
                        re.M | re.S)


def test_every_seed_tool_that_takes_paths_confines_them_with_the_same_code() -> None:
    """Each tool folder stands alone (TOOLS.md), so the check that keeps a caller's path inside
    the user's folder is copied; the copies must be the same, or a fix reaches only some tools."""
    copies = {tool: USER_PATHS.findall((SEED / tool / "index.ts").read_text()) for tool in TOOLS}
    takes_paths = {tool for tool in TOOLS if "output_path" in (SEED / tool / "TOOL.md").read_text()
                   or "_path:" in (SEED / tool / "TOOL.md").read_text()}
    assert takes_paths <= {tool for tool, found in copies.items() if found}, copies
    assert len({block for found in copies.values() for block in found}) == 1, {t: len(f) for t, f in copies.items()}
    assert all(len(found) <= 1 for found in copies.values())
