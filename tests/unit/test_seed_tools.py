"""The seed tools without Docker: manifests, imports, and email_db's SQLite helper on the host.

tests/e2e/test_seed_tools.py runs the same tools in real sandboxes.
"""

from __future__ import annotations

import json
import re
import sqlite3
import subprocess
import sys
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
def test_email_db_helper_leaves_every_write_to_sqlite_to_refuse(mail: Path, sql: str) -> None:
    before = mail.read_bytes()
    answer = helper(mail, action="query", sql=sql, limit=10)
    assert answer["error"] == "sql", answer
    assert "readonly" in answer["message"] or "read-only" in answer["message"] or "query_only" in answer["message"], answer
    assert mail.read_bytes() == before


def test_email_db_helper_runs_one_statement_only(mail: Path) -> None:
    answer = helper(mail, action="query", sql="PRAGMA query_only = 0; DELETE FROM messages", limit=10)
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
