"""web_fetch and web_search on the host: each tool's execute() run by node (loaded by the
shim's own loader) against HTTP servers this file starts on 127.0.0.1.

tests/e2e/test_web_tools.py runs them in real sandboxes, through sandboxd's egress proxy.
Nothing here leaves 127.0.0.1.
"""

from __future__ import annotations

import gzip
import json
import os
import subprocess
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.web_site import RESULTS, Site, closed_port, endless, page, redirect, searxng, serve, stall

REPO = Path(__file__).resolve().parents[2]
SEED = REPO / "seed" / "tools"
SHIM = REPO / "images" / "node" / "shim"

# Reads one JSON request line ({entry, params}) from stdin, runs execute(), and aborts its
# signal when the line "abort" follows. Prints {result, progress, settle_ms}.
HARNESS = r"""
const loader = require(process.env.WT_LOADER);
loader.install({ toolsDirs: process.env.WT_TOOLS });
const ac = new AbortController();
let abortedAt;
let buffered = '';
let started = false;
process.stdin.setEncoding('utf8');
process.stdin.on('data', (chunk) => {
  buffered += chunk;
  let nl;
  while ((nl = buffered.indexOf('\n')) !== -1) {
    const line = buffered.slice(0, nl);
    buffered = buffered.slice(nl + 1);
    if (!started) { started = true; run(JSON.parse(line)); }
    else if (line === 'abort') { abortedAt = Date.now(); ac.abort(new DOMException('cancelled by the test', 'AbortError')); }
  }
});
function run(req) {
  const progress = [];
  const { mod } = loader.load(req.entry);
  mod.execute('call-1', req.params, ac.signal, (u) => progress.push(u.content[0].text)).then(
    (result) => {
      const settle_ms = abortedAt === undefined ? null : Date.now() - abortedAt;
      process.stdout.write(JSON.stringify({ result, progress, settle_ms }));
      process.exit(0);
    },
    (e) => { process.stdout.write(JSON.stringify({ threw: String((e && e.stack) || e) })); process.exit(0); });
}
"""


@pytest.fixture(scope="module", autouse=True)
def esbuild() -> None:
    if subprocess.run(["node", "-e", "require.resolve('esbuild')"], cwd=SHIM, capture_output=True).returncode:
        pytest.fail("the shim's esbuild is missing (it compiles the tools' TypeScript): run `make shim-deps`")


@pytest.fixture
def site() -> Iterator[Site]:
    with serve() as running:
        yield running


@pytest.fixture
def home(tmp_path: Path) -> Path:
    path = tmp_path / "user"
    path.mkdir()
    return path


def run_tool(tool: str, params: dict[str, Any], home: Path, *, env: dict[str, str] | None = None,
             abort_when: threading.Event | None = None, timeout: float = 90) -> dict[str, Any]:
    base_env = {k: v for k, v in os.environ.items() if k != "PI_SEARXNG_URL"}
    proc = subprocess.Popen(
        ["node", "-e", HARNESS], stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env={**base_env, "WT_LOADER": str(SHIM / "src" / "loader.js"), "WT_TOOLS": str(SEED),
             "OFFICER_USER_ROOT": str(home), **(env or {})})
    assert proc.stdin is not None
    proc.stdin.write(json.dumps({"entry": str(SEED / tool / "index.ts"), "params": params}) + "\n")
    proc.stdin.flush()
    if abort_when is not None:
        assert abort_when.wait(30), "the tool never sent its request"
        proc.stdin.write("abort\n")
        proc.stdin.flush()
    try:
        out, errs = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
        raise
    answer = json.loads(out or "{}")
    assert "result" in answer, f"execute threw or the harness failed: {answer} {errs}"
    return answer


def text(answer: dict[str, Any]) -> str:
    return "\n".join(c["text"] for c in answer["result"]["content"])


def ok(answer: dict[str, Any]) -> str:
    assert not answer["result"].get("isError"), text(answer)
    return text(answer)


def failed(answer: dict[str, Any], *words: str) -> str:
    message = text(answer)
    assert answer["result"].get("isError") is True, message
    for word in words:
        assert word in message, message
    return message


ARTICLE = b"""<!DOCTYPE html>
<html><head><meta charset="utf-8"><title>  Caf&eacute; &amp; Th&#233;   Guide </title>
<style>body { color: red } .secret-style {}</style>
<script>document.write("<p>secret-script</p>")</script>
<script type="application/ld+json">{"secret": "json-ld"}</script></head>
<body>
<noscript>secret-noscript: enable JavaScript</noscript>
<svg width="10"><text>secret-svg</text></svg>
<h1>Brewing   at
 home</h1>
<p>Read the <a href="/guide/beans?x=1&amp;y=2">bean guide</a>, the <a href="https://other.example/tea">tea
page</a>, <a href="notes.html">notes</a> and <a href="#top">back to top</a>.</p>
<p>5 &lt; 7 &gt; 3, &quot;quoted&quot;, caf&eacute;, &#x263A;, &#150; dash, &nbsp;end; a&copy=1 stays.</p>
<ul><li>Grind</li><li>Pour<ol><li>slowly</li><li>evenly</li></ol></li></ul>
<table><tr><th>Beans</th><th>Grams</th></tr><tr><td>Arabica</td><td>18</td></tr></table>
<!-- secret-comment -->
<pre>line 1
    indented line 2</pre>
</body></html>
"""


def test_web_fetch_turns_html_into_readable_text(site: Site, home: Path) -> None:
    site.routes["/article"] = page(ARTICLE)
    got = ok(run_tool("web_fetch", {"url": site.base + "/article"}, home))
    assert got.startswith(f"Title: Café & Thé Guide\nURL: {site.base}/article\n\n"), got
    assert "secret" not in got, got  # scripts, styles, JSON-LD, noscript, svg, comments dropped
    assert "# Brewing at home" in got
    # Links kept as text, each URL resolved against the page; a jump within the page adds nothing.
    assert f"bean guide [{site.base}/guide/beans?x=1&y=2]" in got
    assert "tea page [https://other.example/tea]" in got
    assert f"notes [{site.base}/notes.html]" in got
    assert "back to top." in got and "#top" not in got
    assert '5 < 7 > 3, "quoted", café, ☺, – dash,  end; a&copy=1 stays.' in got
    assert "- Grind\n- Pour\n  1. slowly\n  2. evenly" in got
    assert "Beans | Grams\nArabica | 18" in got
    assert "line 1\n    indented line 2" in got
    assert "\n\n\n" not in got and not any(line != line.rstrip() for line in got.splitlines())


def test_web_fetch_decodes_the_page_charset_and_resolves_links_against_base(site: Site, home: Path) -> None:
    site.routes["/latin1"] = page("<title>Menü</title><p>Crème brûlée</p>".encode("cp1252"), "text/html; charset=windows-1252")
    site.routes["/meta"] = page('<html><head><meta charset="iso-8859-1"><base href="https://docs.example/v2/">'
                                '</head><p>Gr\u00fc\u00dfe <a href="api.html">API</a></p>'.encode("latin-1"), "text/html")
    assert "Title: Menü" in ok(run_tool("web_fetch", {"url": site.base + "/latin1"}, home))
    got = ok(run_tool("web_fetch", {"url": site.base + "/meta"}, home))
    assert "Grüße API [https://docs.example/v2/api.html]" in got, got


def test_web_fetch_passes_text_and_json_through_and_cuts_at_max_chars(site: Site, home: Path) -> None:
    data = json.dumps({"name": "sandboxd", "tags": ["<b>not html</b>"]}).encode()
    site.routes["/data.json"] = page(data, "application/json")
    site.routes["/notes.txt"] = page(b"<p>plain text, not HTML</p>\n" + b"x" * 5000, "text/plain; charset=utf-8")
    got = ok(run_tool("web_fetch", {"url": site.base + "/data.json"}, home))
    assert got.endswith("\n\n" + data.decode()) and "Content-Type: application/json" in got, got
    got = ok(run_tool("web_fetch", {"url": site.base + "/notes.txt", "max_chars": 100}, home))
    assert "<p>plain text, not HTML</p>" in got
    assert "[cut at 100 of 5028 characters: pass output_path to save the whole text" in got, got


def test_web_fetch_writes_a_big_page_to_output_path_and_returns_a_summary(site: Site, home: Path) -> None:
    paragraphs = "".join(f"<p>Paragraph {i} of the long report.</p>" for i in range(20_000))
    site.routes["/long"] = page(f"<title>Long report</title><body>{paragraphs}</body>".encode())
    inline = ok(run_tool("web_fetch", {"url": site.base + "/long"}, home))
    assert len(inline) < 21_000 and "[cut at 20000 of " in inline, inline[-300:]

    (home / "reports").mkdir()
    summary = ok(run_tool("web_fetch", {"url": site.base + "/long", "output_path": "reports/long.txt"}, home))
    saved = (home / "reports" / "long.txt").read_text()
    assert saved.startswith(f"Title: Long report\nURL: {site.base}/long\n\n")
    assert "Paragraph 0 of" in saved and "Paragraph 19999 of the long report." in saved
    body = saved.split("\n\n", 1)[1].rstrip("\n")
    assert f"Saved {len(body)} characters (39999 lines) of text to {home}/reports/long.txt." in summary, summary
    assert len(summary) < 2_000 and "Paragraph 19999" not in summary


def test_web_fetch_refuses_an_output_path_outside_the_user_folder(site: Site, home: Path, tmp_path: Path) -> None:
    site.routes["/x"] = page(b"<p>x</p>")
    (home / "out").symlink_to(tmp_path)
    failed(run_tool("web_fetch", {"url": site.base + "/x", "output_path": "/tmp/x.txt"}, home),
           "output_path must be inside", str(home))
    failed(run_tool("web_fetch", {"url": site.base + "/x", "output_path": "out/x.txt"}, home),
           "output_path must be inside", "through a link")
    failed(run_tool("web_fetch", {"url": site.base + "/x", "output_path": "missing/x.txt"}, home), "does not exist")
    assert not (tmp_path / "x.txt").exists() and site.requests == []  # refused before any fetch


def test_web_fetch_summarises_binary_content_and_saves_it_whole(site: Site, home: Path) -> None:
    png = b"\x89PNG\r\n\x1a\n" + bytes(range(256)) * 40
    site.routes["/logo.png"] = page(png, "image/png")
    site.routes["/blob"] = page(b"\x00\x01\x02binary" * 100, "application/octet-stream")
    got = ok(run_tool("web_fetch", {"url": site.base + "/logo.png"}, home))
    assert f"Binary content (image/png), {len(png)} bytes: not shown as text." in got and "PNG" not in got.split("\n\n")[1][20:]
    assert "Pass output_path to save the file." in got
    got = ok(run_tool("web_fetch", {"url": site.base + "/logo.png", "output_path": "logo.png"}, home))
    assert f"Saved the {len(png)} bytes to {home}/logo.png" in got
    assert (home / "logo.png").read_bytes() == png
    assert "Binary content (application/octet-stream), 900 bytes" in ok(run_tool("web_fetch", {"url": site.base + "/blob"}, home))


@pytest.mark.parametrize("status", [404, 503])
def test_web_fetch_http_errors_are_tool_errors_with_status_and_excerpt(site: Site, home: Path, status: int) -> None:
    site.routes["/broken"] = page(b"<html><title>Oops</title><body><h1>Service down</h1><script>x()</script>"
                                  b"<p>Try again in five minutes.</p></body></html>", status=status)
    message = failed(run_tool("web_fetch", {"url": site.base + "/broken"}, home), f"HTTP {status} ", site.base + "/broken")
    assert "# Service down Try again in five minutes." in message and "x()" not in message, message
    failed(run_tool("web_fetch", {"url": site.base + "/nothing-here"}, home), "HTTP 404 Not Found", "No page at this address")


def test_web_fetch_follows_a_redirect_chain_and_names_it(site: Site, home: Path) -> None:
    site.routes["/start"] = redirect(301, "/hop")
    site.routes["/hop"] = redirect(302, site.base + "/hop2")
    site.routes["/hop2"] = redirect(307, "final?from=hop2")
    site.routes["/final"] = page(b"<title>Arrived</title><p>the end</p>")
    got = ok(run_tool("web_fetch", {"url": site.base + "/start"}, home))
    assert got.startswith(f"Title: Arrived\nURL: {site.base}/final?from=hop2\n"
                          f"Redirected from: {site.base}/start → {site.base}/hop → {site.base}/hop2\n"), got
    assert site.requests == ["/start", "/hop", "/hop2", "/final?from=hop2"]  # one request per hop, made by the tool


def test_web_fetch_stops_a_redirect_loop_and_a_redirect_out_of_the_web(site: Site, home: Path) -> None:
    site.routes["/loop"] = redirect(302, "/loop")
    site.routes["/to-file"] = redirect(302, "file:///etc/passwd")
    failed(run_tool("web_fetch", {"url": site.base + "/loop"}, home), "redirected more than 10 times")
    assert len(site.requests) == 11
    failed(run_tool("web_fetch", {"url": site.base + "/to-file"}, home),
           "redirected to file:///etc/passwd; web_fetch follows http and https only")


def test_web_fetch_reads_at_most_5_mib_of_an_endless_response(site: Site, home: Path) -> None:
    site.routes["/endless"] = endless
    # Without the cap the tool would read until its timeout (60 s) and answer "timed out".
    got = ok(run_tool("web_fetch", {"url": site.base + "/endless", "timeout_seconds": 60}, home))
    assert "[web_fetch stopped reading after 5.0 MiB: the response is larger; what follows is its beginning only.]" in got
    assert "all work and no play" in got and "[cut at 20000 of 5242880 characters" in got, got[-200:]


def test_web_fetch_counts_the_5_mib_after_decompression(site: Site, home: Path) -> None:
    bomb = gzip.compress(b"z" * (64 << 20), compresslevel=9)  # 64 MiB of text in ~64 KiB
    site.routes["/bomb"] = page(bomb, "text/plain", headers={"Content-Encoding": "gzip"})
    got = ok(run_tool("web_fetch", {"url": site.base + "/bomb", "max_chars": 10}, home))
    assert len(bomb) < 1 << 20 and "[web_fetch stopped reading after 5.0 MiB" in got, got
    assert "zzzzzzzzzz\n\n[cut at 10 of 5242880 characters" in got, got


def test_web_fetch_honours_the_abort_signal(site: Site, home: Path) -> None:
    arrived, hung_up = threading.Event(), threading.Event()
    site.routes["/slow"] = stall(arrived, hung_up)
    answer = run_tool("web_fetch", {"url": site.base + "/slow", "timeout_seconds": 120}, home, abort_when=arrived)
    failed(answer, f"web_fetch of {site.base}/slow was cancelled")
    assert answer["settle_ms"] < 10_000, answer  # not the 120 s timeout
    assert hung_up.wait(10), "the tool kept the connection open after it was cancelled"


def test_web_fetch_gives_up_after_its_timeout(site: Site, home: Path) -> None:
    arrived, hung_up = threading.Event(), threading.Event()
    site.routes["/slow"] = stall(arrived, hung_up)
    failed(run_tool("web_fetch", {"url": site.base + "/slow", "timeout_seconds": 1}, home),
           "timed out after 1 s", "timeout_seconds")
    assert hung_up.wait(10)


def test_web_fetch_reports_sandboxd_egress_refusals_readably(site: Site, home: Path) -> None:
    # What sandboxd's egress proxy answers to a refused plain-http request (the e2e test gets the real one).
    line = b"egress to 10.0.0.5:80 refused by sandboxd's egress policy: private address (RFC 1918); the operator can allow it with egress.allow"
    site.routes["/refused"] = page(line, "text/plain; charset=utf-8", 403, {"X-Sandboxd-Egress": "refused"})
    message = failed(run_tool("web_fetch", {"url": site.base + "/refused"}, home))
    assert message == f"Could not fetch {site.base}/refused: {line.decode()}", message


def test_web_fetch_names_bad_input_and_unreachable_servers(site: Site, home: Path) -> None:
    failed(run_tool("web_fetch", {"url": "file:///etc/passwd"}, home), "url must be http:// or https://, got file:")
    failed(run_tool("web_fetch", {"url": "ftp://example.com/x"}, home), "url must be http:// or https://")
    failed(run_tool("web_fetch", {"url": "not a url"}, home), "is not a URL", "https://example.com/page")
    failed(run_tool("web_fetch", {}, home), "url is required")
    failed(run_tool("web_fetch", {"url": site.base, "max_chars": 0}, home), "max_chars must be a whole number from 1 to 500000")
    failed(run_tool("web_fetch", {"url": site.base, "timeout_seconds": 1.5}, home), "timeout_seconds must be a whole number")
    gone = f"http://127.0.0.1:{closed_port()}/gone"
    failed(run_tool("web_fetch", {"url": gone}, home), f"Could not fetch {gone}: fetch failed", "ECONNREFUSED")


# ---- web_search ---------------------------------------------------------------------------

def test_web_search_numbers_results_with_title_url_and_snippet(site: Site, home: Path) -> None:
    seen: list[dict[str, list[str]]] = []
    site.routes["/searx/search"] = searxng(RESULTS, seen)
    env = {"PI_SEARXNG_URL": site.base + "/searx/"}
    got = ok(run_tool("web_search", {"query": "sandbox egress & more"}, home, env=env))
    assert seen == [{"q": ["sandbox egress & more"], "format": ["json"]}]
    assert got.startswith('3 results for "sandbox egress & more":\n\n'
                          "1. First result (2026-03-04)\n   https://one.example/a\n   About sandboxes and egress.\n\n"
                          "2. https://two.example/b\n   https://two.example/b\n\n"
                          "3. Third\n   https://three.example/c\n   " + "x" * 400 + "…\n"), got
    assert got.endswith("Answer: 42\n\nRelated searches: sandbox proxy; egress filtering"), got
    assert ok(run_tool("web_search", {"query": "q", "max_results": 1}, home, env=env)).count("https://") == 1


def test_web_search_caps_max_results(site: Site, home: Path) -> None:
    many = {"results": [{"url": f"https://r{i}.example/", "title": f"R{i}", "content": ""} for i in range(80)]}
    site.routes["/search"] = searxng(many, [])
    got = ok(run_tool("web_search", {"query": "q", "max_results": 500}, home, env={"PI_SEARXNG_URL": site.base}))
    assert got.startswith('50 results for "q" (max_results is capped at 50):') and "\n50. R49\n" in got and "R50" not in got
    failed(run_tool("web_search", {"query": "q", "max_results": 0}, home, env={"PI_SEARXNG_URL": site.base}),
           "max_results must be a whole number from 1 to 50")
    assert "10 results" in ok(run_tool("web_search", {"query": "q"}, home, env={"PI_SEARXNG_URL": site.base}))


def test_web_search_without_pi_searxng_url_says_who_sets_it(home: Path) -> None:
    failed(run_tool("web_search", {"query": "anything"}, home),
           "PI_SEARXNG_URL is not set", "pi-bridge", "calls.allowed_env")
    failed(run_tool("web_search", {"query": "anything"}, home, env={"PI_SEARXNG_URL": "searxng:8080"}),
           "PI_SEARXNG_URL must be an http:// or https:// address")
    failed(run_tool("web_search", {"query": "  "}, home, env={"PI_SEARXNG_URL": "http://127.0.0.1:9"}), "query is required")


def test_web_search_explains_a_json_api_that_is_turned_off(site: Site, home: Path) -> None:
    site.routes["/search"] = searxng(b"<html>Forbidden</html>", [], status=403, content_type="text/html")
    failed(run_tool("web_search", {"query": "q"}, home, env={"PI_SEARXNG_URL": site.base}),
           "answered HTTP 403 to format=json", "settings.yml", "formats: [html, json]")


def test_web_search_names_answers_that_are_not_searxng_json(site: Site, home: Path) -> None:
    site.routes["/html/search"] = searxng(b"<!DOCTYPE html><html>a login page</html>", [], content_type="text/html")
    site.routes["/other/search"] = searxng({"items": []}, [])
    failed(run_tool("web_search", {"query": "q"}, home, env={"PI_SEARXNG_URL": site.base + "/html"}),
           "did not answer with JSON", "text/html", "<!DOCTYPE html>", "base address of a SearXNG instance")
    failed(run_tool("web_search", {"query": "q"}, home, env={"PI_SEARXNG_URL": site.base + "/other"}),
           'answered JSON without a "results" list')
    failed(run_tool("web_search", {"query": "q"}, home, env={"PI_SEARXNG_URL": site.base + "/nowhere"}),
           "answered HTTP 404", "the one whose /search answers")


def test_web_search_with_no_results_names_the_engines_that_failed(site: Site, home: Path) -> None:
    site.routes["/search"] = searxng({"results": [], "unresponsive_engines": [["google", "timeout"]]}, [])
    got = ok(run_tool("web_search", {"query": "rare words"}, home, env={"PI_SEARXNG_URL": site.base}))
    assert got == 'No results for "rare words".\n\nEngines that did not answer: google (timeout). Try again later or rephrase.'


def test_web_search_reports_egress_refusals_and_a_searxng_that_is_down(site: Site, home: Path) -> None:
    line = b"egress to 10.1.2.3:8080 refused by sandboxd's egress policy: private address (RFC 1918); the operator can allow it with egress.allow"
    site.routes["/search"] = page(line, "text/plain; charset=utf-8", 403, {"X-Sandboxd-Egress": "refused"})
    failed(run_tool("web_search", {"query": "q"}, home, env={"PI_SEARXNG_URL": site.base}),
           line.decode(), "allow SearXNG's host and port in egress.allow")
    down = f"http://127.0.0.1:{closed_port()}"
    failed(run_tool("web_search", {"query": "q"}, home, env={"PI_SEARXNG_URL": down}),
           f"Could not reach SearXNG at {down}", "ECONNREFUSED", "Check that SearXNG runs")


def test_web_search_honours_the_abort_signal(site: Site, home: Path) -> None:
    arrived, hung_up = threading.Event(), threading.Event()
    site.routes["/search"] = stall(arrived, hung_up)
    answer = run_tool("web_search", {"query": "q"}, home, env={"PI_SEARXNG_URL": site.base}, abort_when=arrived)
    failed(answer, "web_search was cancelled")
    assert answer["settle_ms"] < 10_000 and hung_up.wait(10), answer
