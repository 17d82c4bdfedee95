"""The seed tools (seed/tools: email_db, ffmpeg, convert_audio_to_mp3, ocr) in real sandboxes.

The daemon syncs seed/tools at start; every input is made here: a WAV written with
Python's wave module, a PNG rendered in the sandbox by the ffmpeg tool (drawtext with
the image's DejaVu font), a PDF written by hand, an SQLite file at
DATA_PATH/email/<user>/emails.db. Bad input: a file that is not audio, a missing file,
write statements (one behind WITH), paths outside /officer/user (one through a link).
"""

from __future__ import annotations

import json
import math
import sqlite3
import struct
import time
import wave
import zlib
from pathlib import Path
from typing import Any

import pytest

from sandboxd.client import Client

from tests.e2e.conftest import Daemon
from tests.e2e.results import ok, refused, text

pytestmark = pytest.mark.docker

A, B = "alice@example.com", "bob@example.com"


def call(client: Client, name: str, arguments: dict[str, Any], progress: list[str] | None = None,
         user: str = A, **extra: Any) -> dict[str, Any]:
    result = client.request(
        "tools/call", {"user": user, "name": name, "arguments": arguments, **extra},
        on_progress=(lambda p: progress.append(p["content"][0]["text"])) if progress is not None else None)
    assert result["status"] in ("ok", "error"), result  # the tool answered (no crash, no timeout)
    return result


def user_dir(daemon: Daemon) -> Path:
    path = daemon.user_dir(A)
    path.mkdir(parents=True, exist_ok=True)
    return path


def write_wav(path: Path, seconds: float = 3.0, rate: int = 16000) -> None:
    with wave.open(str(path), "wb") as out:
        out.setnchannels(1)
        out.setsampwidth(2)
        out.setframerate(rate)
        out.writeframes(b"".join(struct.pack("<h", int(12000 * math.sin(2 * math.pi * 440 * i / rate)))
                                 for i in range(int(seconds * rate))))
    path.chmod(0o644)


def write_pdf(path: Path, line: str) -> None:
    """A one-page PDF whose text layer says `line` (Helvetica, not embedded)."""
    stream = f"BT /F1 24 Tf 72 700 Td ({line}) Tj ET".encode()
    write_pdf_objects(path, [
        b"<< /Type /Catalog /Pages 2 0 R >>",
        b"<< /Type /Pages /Kids [3 0 R] /Count 1 >>",
        b"<< /Type /Page /Parent 2 0 R /MediaBox [0 0 612 792] /Contents 4 0 R /Resources << /Font << /F1 5 0 R >> >> >>",
        b"<< /Length %d >>\nstream\n%s\nendstream" % (len(stream), stream),
        b"<< /Type /Font /Subtype /Type1 /BaseFont /Helvetica >>",
    ])


def write_pdf_objects(path: Path, objects: list[bytes]) -> None:
    body, offsets = b"%PDF-1.4\n", []
    for number, obj in enumerate(objects, 1):
        offsets.append(len(body))
        body += b"%d 0 obj\n%s\nendobj\n" % (number, obj)
    xref = len(body)
    body += b"xref\n0 %d\n0000000000 65535 f \n" % (len(objects) + 1)
    body += b"".join(b"%010d 00000 n \n" % o for o in offsets)
    body += b"trailer\n<< /Size %d /Root 1 0 R >>\nstartxref\n%d\n%%%%EOF\n" % (len(objects) + 1, xref)
    path.write_bytes(body)
    path.chmod(0o644)


def write_scanned_pdf(path: Path, gray: bytes, width: int, height: int) -> None:
    """A one-page PDF holding only an image (8-bit gray pixels): no text layer, as a scan."""
    pixels = zlib.compress(gray)
    content = b"q %d 0 0 %d 36 500 cm /Scan Do Q" % (width // 2, height // 2)
    objects = [
        b"<< /Type /Catalog /Pages 2 0 R >>",
        b"<< /Type /Pages /Kids [3 0 R] /Count 1 >>",
        b"<< /Type /Page /Parent 2 0 R /MediaBox [0 0 612 792] /Contents 4 0 R"
        b" /Resources << /XObject << /Scan 5 0 R >> >> >>",
        b"<< /Length %d >>\nstream\n%s\nendstream" % (len(content), content),
        b"<< /Type /XObject /Subtype /Image /Width %d /Height %d /ColorSpace /DeviceGray /BitsPerComponent 8"
        b" /Filter /FlateDecode /Length %d >>\nstream\n%s\nendstream" % (width, height, len(pixels), pixels),
    ]
    write_pdf_objects(path, objects)


def make_mail(path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with sqlite3.connect(path) as db:
        # WAL, as a mail sync that reads while it writes would leave it: a read-only open
        # then needs a -shm file beside the database (the host's, in the folder /officer/data is).
        db.execute("PRAGMA journal_mode=WAL")
        db.execute("CREATE TABLE messages (id INTEGER PRIMARY KEY, subject TEXT, sender TEXT, body TEXT)")
        db.execute("CREATE TABLE labels (name TEXT)")  # nothing to search in: skipped by search
        db.executemany("INSERT INTO messages (subject, sender, body) VALUES (?, ?, ?)", [
            ("Invoice 1042", "billing@shop.example", "Your invoice is attached."),
            ("Lunch?", "bob@example.com", "Noon at the usual place, 100% sure"),
            ("Re: Lunch?", "alice@example.com", "Yes!"),
        ])
        db.executemany("INSERT INTO labels VALUES (?)", [("inbox",), ("work",)])
    db.close()


def message_count(path: Path) -> int:
    with sqlite3.connect(path) as db:
        (n,) = db.execute("SELECT count(*) FROM messages").fetchone()
    db.close()
    return n


def test_email_db_reads_any_schema_and_sqlite_refuses_every_write(make_daemon: Any) -> None:
    daemon = make_daemon()
    db = daemon.data / "email" / A / "emails.db"
    make_mail(db)  # before A's sandbox starts: the database is mounted when it exists then
    with daemon.client() as client:
        refused(call(client, "email_db", {"action": "stats"}, user=B), "No email database at /officer/data/emails.db")

        stats = ok(call(client, "email_db", {"action": "stats"}))
        assert "messages: 3 rows" in stats and "labels: 2 rows" in stats
        assert "CREATE TABLE messages" in ok(call(client, "email_db", {"action": "schema"}))
        rows = ok(call(client, "email_db", {"action": "query", "limit": 2,
                                            "sql": "SELECT subject, sender FROM messages ORDER BY id"}))
        assert "1. subject: Invoice 1042 | sender: billing@shop.example" in rows and "Re: Lunch?" not in rows
        assert "more rows exist" in rows
        found = ok(call(client, "email_db", {"action": "search", "text": "lunch"}))
        assert "messages (2 matches)" in found and "Invoice" not in found
        # LIKE's wildcards in the text are literal: "100%" matches one message, "%" alone too.
        one = ok(call(client, "email_db", {"action": "search", "text": "100%"}))
        assert "messages (1 match):" in one, one
        assert ok(call(client, "email_db", {"action": "query", "sql": "SELECT 1 AS one"})).startswith("1 result:\n")
        out = ok(call(client, "email_db", {"action": "query", "sql": "SELECT * FROM messages",
                                           "output_path": "/officer/user/mail.json"}))
        assert "3 items saved to /officer/user/mail.json" in out
        assert len(json.loads((daemon.user_dir(A) / "mail.json").read_text())["rows"]) == 3

        # The mount is read-write (test_daemon.py proves a sandbox can write it): each refusal
        # below is SQLite's authorizer (behind it, the read-only open and query_only).
        for sql in ["DELETE FROM messages",
                    "WITH doomed AS (SELECT id FROM messages) DELETE FROM messages WHERE id IN doomed",
                    "INSERT INTO messages (subject) VALUES ('planted')",
                    "UPDATE messages SET body = ''",
                    "DROP TABLE labels",
                    "CREATE TABLE planted (x)",
                    "PRAGMA user_version = 7"]:
            refused(call(client, "email_db", {"action": "query", "sql": sql}), "SQL error",
                    "is refused: email_db runs read-only statements only", "only SELECT statements")
        # A second statement is never run. Each error's hint fits it, and none is doubled ("at a time.. Only").
        two = call(client, "email_db", {"action": "query", "sql": "SELECT 1; DELETE FROM messages"})
        refused(two, "one statement at a time. Send one statement per call.")
        syntax = call(client, "email_db", {"action": "query", "sql": "SELEKT 1"})
        refused(syntax, "SQL error", "syntax error", "See action=schema")
        refused(call(client, "email_db", {"action": "query", "sql": "SELECT * FROM nope"}), "no such table: nope")
        for answer in (two, syntax):
            assert ".." not in text(answer) and "Only one read-only statement" not in text(answer), text(answer)
        refused(call(client, "email_db", {"action": "query"}), "sql is required")
        refused(call(client, "email_db", {"action": "stats", "output_path": "/tmp/out.json"}),
                "output_path must be inside /officer/user")
    assert message_count(db) == 3
    with sqlite3.connect(db) as check:
        assert check.execute("PRAGMA user_version").fetchone() == (0,)
        assert check.execute("SELECT name FROM sqlite_master WHERE name = 'planted'").fetchone() is None
    check.close()


def test_email_db_creates_no_file_and_stops_a_query_at_its_budget(make_daemon: Any) -> None:
    """Hostile SQL through the seed tool: files made through ATTACH and VACUUM INTO, a query without end."""
    daemon = make_daemon()
    db = daemon.data / "email" / A / "emails.db"
    make_mail(db)
    home = user_dir(daemon)
    with daemon.client() as client:
        for sql, named in [("ATTACH '/officer/user/x.db' AS x", "ATTACH"),
                           ("VACUUM INTO '/officer/user/copy.db'", "VACUUM INTO attach a database too"),
                           ("VACUUM INTO '/officer/data/copy.db'", "VACUUM INTO attach a database too"),
                           ("PRAGMA journal_mode = DELETE", "PRAGMA journal_mode = DELETE is refused")]:
            refused(call(client, "email_db", {"action": "query", "sql": sql}), "SQL error", named)
        started = time.monotonic()
        endless = "WITH RECURSIVE r(i) AS (SELECT 1 UNION ALL SELECT i + 1 FROM r) SELECT count(*) FROM r"
        refused(call(client, "email_db", {"action": "query", "sql": endless, "timeout_seconds": 2}),
                "longer than its time budget of 2 s")
        assert time.monotonic() - started < 10  # the budget, not the call's 30 s deadline
        joined = "SELECT count(*) FROM messages a, messages b, messages c, messages d, messages e, messages f, " \
                 "messages g, messages h, messages i, messages j, messages k, messages l, messages m, messages n, " \
                 "messages o, messages p, messages q, messages r, messages s, messages t, messages u, messages v"
        refused(call(client, "email_db", {"action": "query", "sql": joined, "timeout_seconds": 1}), "time budget of 1 s")
        doubling = "WITH RECURSIVE r(x) AS (SELECT 'a' UNION ALL SELECT x || x FROM r) SELECT length(x) FROM r LIMIT 40"
        refused(call(client, "email_db", {"action": "query", "sql": doubling, "limit": 50}), "more than 64 MiB of memory")
        assert "messages: 3 rows" in ok(call(client, "email_db", {"action": "stats"}))  # the same sandbox, still fine
    assert sorted(p.name for p in home.iterdir()) == ["tools"]
    assert sorted(p.name for p in db.parent.iterdir() if not p.name.startswith("emails.db")) == []


def test_a_cancelled_email_db_query_stops_within_the_grace(make_daemon: Any, docker_api: Any) -> None:
    # The helper runs beside the shim's event loop, not blocking it: the AbortSignal reaches it.
    daemon = make_daemon("calls:\n  cancel_grace_ms: 3000\n")
    make_mail(daemon.data / "email" / A / "emails.db")
    endless = "WITH RECURSIVE r(i) AS (SELECT 1 UNION ALL SELECT i + 1 FROM r) SELECT count(*) FROM r"
    with daemon.client() as client:
        client.send({"jsonrpc": "2.0", "id": 1, "method": "tools/call", "params": {
            "user": A, "name": "email_db", "arguments": {"action": "query", "sql": endless, "timeout_seconds": 120}}})
        time.sleep(2)  # the query runs
        client.cancel(1, "user pressed stop")
        while "id" not in (reply := client.read_message()):
            pass
        result = reply["result"]
        assert result["status"] == "cancelled" and "killed" not in text(result), result
        assert "messages: 3 rows" in ok(call(client, "email_db", {"action": "stats"}))


def test_ffmpeg_renders_and_ocr_reads_it_back(make_daemon: Any) -> None:
    daemon = make_daemon()
    home = user_dir(daemon)
    write_pdf(home / "letter.pdf", "Quarterly report for Alice")
    with daemon.client() as client:
        progress: list[str] = []
        font = "/usr/share/fonts/truetype/dejavu/DejaVuSans.ttf"
        rendered = ok(call(client, "ffmpeg", {
            "args": json.dumps(["-f", "lavfi", "-i", "color=white:s=900x200:d=1",
                                "-vf", f"drawtext=fontfile={font}:text=SANDBOX OCR 4217:fontsize=72:"
                                       "fontcolor=black:x=40:y=60",
                                "-frames:v", "1", "sign.png"]),
            "output_path": "render.log"}, progress))
        assert "Wrote sign.png" in rendered and "Full log saved to /officer/user/render.log" in rendered
        assert progress and all(p.startswith("ffmpeg: ") for p in progress), progress
        assert "Output #0, image2, to 'sign.png'" in (home / "render.log").read_text()
        assert (home / "sign.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

        probe = ok(call(client, "ffmpeg", {"program": "ffprobe", "args": json.dumps(
            ["-v", "error", "-show_entries", "stream=width,height", "-of", "json", "sign.png"])}))
        assert json.loads(probe)["streams"][0] == {"width": 900, "height": 200}

        assert "SANDBOX OCR 4217" in ok(call(client, "ocr", {"image_path": "/officer/user/sign.png"}))
        assert "Recognised" in ok(call(client, "ocr", {"image_path": "sign.png", "output_path": "sign.txt"}))
        assert "SANDBOX OCR 4217" in (home / "sign.txt").read_text()
        assert "Quarterly report for Alice" in ok(call(client, "ocr", {"image_path": "letter.pdf"}))

        # A JPEG, and a scanned PDF (only an image, no text layer: rendered, then read).
        ok(call(client, "ffmpeg", {"args": json.dumps(["-i", "sign.png", "sign.jpg"])}))
        assert "SANDBOX OCR 4217" in ok(call(client, "ocr", {"image_path": "sign.jpg"}))
        ok(call(client, "ffmpeg", {"args": json.dumps(["-i", "sign.png", "-f", "rawvideo", "-pix_fmt", "gray",
                                                      "sign.gray"])}))
        write_scanned_pdf(home / "scan.pdf", (home / "sign.gray").read_bytes(), 900, 200)
        progress.clear()
        assert "SANDBOX OCR 4217" in ok(call(client, "ocr", {"image_path": "scan.pdf"}, progress))
        assert any("no text layer" in p for p in progress), progress

        refused(call(client, "ffmpeg", {"args": "-i sign.png out.mp4"}), "args must be a JSON array of strings")
        refused(call(client, "ffmpeg", {"args": json.dumps(["-i", "missing.wav", "x.mp3"])}),
                "ffmpeg exited with status", "No such file or directory")
        refused(call(client, "ocr", {"image_path": "letter.pdf", "page": 2}), "page 2 is out of range", "1 page")
        refused(call(client, "ocr", {"image_path": "sign.png", "lang": "xyz"}), "language xyz is not installed", "eng")
        refused(call(client, "ocr", {"image_path": "render.log"}), "render.log is not an image (it is text)")


def test_convert_audio_to_mp3_converts_a_wav_and_refuses_what_is_not_audio(make_daemon: Any) -> None:
    daemon = make_daemon()
    home = user_dir(daemon)
    (home / "voice").mkdir()
    (home / "voice").chmod(0o777)
    write_wav(home / "voice" / "memo.wav", seconds=3.0)
    (home / "notes.wav").write_text("not audio at all\n")
    (home / "notes.wav").chmod(0o644)
    with daemon.client() as client:
        progress: list[str] = []
        done = ok(call(client, "convert_audio_to_mp3", {"input_path": "/officer/user/voice/memo.wav", "bitrate": "64k"},
                       progress))
        assert "Converted to /officer/user/voice/memo.mp3" in done, done
        duration = float(done.split("Duration: ")[1].split(" s")[0])
        assert 2.9 < duration < 3.2, done
        mp3 = home / "voice" / "memo.mp3"
        assert f"Size: {mp3.stat().st_size} bytes" in done
        assert mp3.read_bytes()[:3] == b"ID3" or mp3.read_bytes()[0] == 0xFF
        assert progress[0].startswith("Converting memo.wav (3.0 s) to MP3 at 64k"), progress
        assert any(p.startswith("Converting: ") and p.endswith("%") for p in progress), progress

        assert "Bitrate: 64 kb/s" in done.splitlines(), done

        # At 22050 Hz MP3 carries at most 160 kb/s: the default 192k comes out as 160, and says so.
        write_wav(home / "voice" / "low.wav", seconds=1.0, rate=22050)
        low = ok(call(client, "convert_audio_to_mp3", {"input_path": "voice/low.wav"}))
        assert "Bitrate: 160 kb/s (192k was asked, the most MP3 allows at 22050 Hz)" in low.splitlines(), low
        # Not audio, for the OCR tool: said as such, not Tesseract's echo of the bytes.
        refused(call(client, "ocr", {"image_path": "voice/low.wav"}), "is not an image (it is a WAV audio file)")

        # ffmpeg's progress counts to the output's length (-t), and ends at 100%.
        progress.clear()
        ok(call(client, "ffmpeg", {"args": json.dumps(["-i", "voice/memo.wav", "-t", "1.5", "voice/cut.wav"])}, progress))
        assert progress and progress[-1].startswith("ffmpeg: 1.5 s processed (100%)"), progress

        refused(call(client, "convert_audio_to_mp3", {"input_path": "notes.wav"}),
                "is not an audio or video file ffmpeg can read")
        refused(call(client, "convert_audio_to_mp3", {"input_path": "gone.wav"}),
                "input_path: no such file: /officer/user/gone.wav")
        refused(call(client, "convert_audio_to_mp3", {"input_path": "voice/memo.wav", "bitrate": "loud"}),
                "bitrate must be from 32k to 320k")
        refused(call(client, "convert_audio_to_mp3", {"input_path": "voice/memo.wav", "output_path": "voice/memo.wav"}),
                "output_path is the input file itself")
    assert not (home / "notes.mp3").exists()


def test_seed_tools_refuse_paths_outside_the_user_folder(make_daemon: Any) -> None:
    daemon = make_daemon()
    home = user_dir(daemon)
    write_wav(home / "memo.wav", seconds=0.5)
    # Links inside /officer/user that point out of it: to a file and to a folder.
    (home / "hosts.png").symlink_to("/etc/hosts")
    (home / "outside").symlink_to("/tmp")
    with daemon.client() as client:
        outside = "must be inside /officer/user"
        refused(call(client, "ocr", {"image_path": "/etc/hostname"}), "image_path " + outside)
        refused(call(client, "ocr", {"image_path": "../../etc/hostname"}), "image_path " + outside)
        refused(call(client, "ocr", {"image_path": "hosts.png"}), "image_path " + outside, "resolves to /etc/hosts")
        refused(call(client, "convert_audio_to_mp3", {"input_path": "/opt/sandboxd/shim/package.json"}),
                "input_path " + outside)
        refused(call(client, "convert_audio_to_mp3", {"input_path": "memo.wav", "output_path": "/tmp/memo.mp3"}),
                "output_path " + outside)
        refused(call(client, "convert_audio_to_mp3", {"input_path": "memo.wav", "output_path": "outside/memo.mp3"}),
                "output_path " + outside, "resolves to /tmp/memo.mp3")
        refused(call(client, "ffmpeg", {"program": "ffprobe", "args": json.dumps(["-version"]),
                                        "output_path": "outside/probe.log"}),
                "output_path " + outside, "resolves to /tmp/probe.log")
        refused(call(client, "ocr", {"image_path": "memo.wav", "output_path": "/officer/tools/x.txt"}),
                "output_path " + outside)


def undeclare(manifest: Path) -> None:
    """The tool's permissions block taken out: it then gets every call env name, as before issue 48."""
    head, rest = manifest.read_text().split("\npermissions:", 1)
    manifest.write_text(head + "\n---" + rest.split("\n---", 1)[1])


def test_a_missing_binary_is_a_helpful_error(make_daemon: Any) -> None:
    # A PATH without /usr/bin stands in for an image that lacks the binaries.
    daemon = make_daemon("calls:\n  allowed_env: [PATH]\n")
    for tool in ("ffmpeg", "convert_audio_to_mp3", "ocr", "email_db"):
        undeclare(daemon.data / "tools" / tool / "TOOL.md")  # a declared tool's calls get no PATH (issue 48)
    write_wav(user_dir(daemon) / "memo.wav", seconds=0.5)
    make_mail(daemon.data / "email" / A / "emails.db")
    with daemon.client() as client:
        for name, arguments, binary in [
            ("ffmpeg", {"args": json.dumps(["-version"])}, "ffmpeg"),
            ("ffmpeg", {"program": "ffprobe", "args": json.dumps(["-version"])}, "ffprobe"),
            ("convert_audio_to_mp3", {"input_path": "memo.wav"}, "ffmpeg"),
            ("ocr", {"image_path": "memo.wav"}, "tesseract"),
        ]:
            result = client.request("tools/call", {"user": A, "name": name, "arguments": arguments,
                                                   "env": {"PATH": "/usr/local/bin"}})
            refused(result, f"{binary} is not installed in the sandbox")
        result = client.request("tools/call", {"user": A, "name": "email_db", "arguments": {"action": "stats"},
                                               "env": {"PATH": "/usr/local/bin"}})
        refused(result, "python3 is required to read the email database")


def test_ffmpeg_flooding_stdout_keeps_the_sandbox_within_its_memory(make_daemon: Any) -> None:
    # 600 MB of raw audio to stdout in a 256 MiB sandbox: kept whole, it would kill the tool. It
    # takes 5 s under runc, 26-30 s under gVisor's ptrace platform: the deadline is not the test.
    daemon = make_daemon("sandbox:\n  memory: 256m\n")
    with daemon.client() as client:
        result = call(client, "ffmpeg", {"args": json.dumps(
            ["-f", "lavfi", "-i", "anullsrc=r=192000:cl=7.1", "-t", "200", "-f", "s16le", "-"])}, timeoutMs=180_000)
        assert "Wrote pipe:." in ok(result) and "audio:600000kB" in text(result)
