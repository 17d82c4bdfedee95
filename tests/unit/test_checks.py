"""Code checks of entry files (TOOLS.md "Common Mistakes"), and the "bump version" check.

Every check has a case it must flag and one it must not; TOOLS.md's own examples
(copied verbatim below, completed into whole files where the spec shows a
fragment) must produce no finding at all.
"""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sandboxd.cli.main import main
from sandboxd.dev.lint.validation import validate_paths
from sandboxd.dev.lint import EXPORT_FIX, check_entry_file, check_entry_source, check_synced_copy

REPO = Path(__file__).resolve().parents[2]


def findings(source: str, name: str = "index.ts") -> list[tuple[str | None, int | None, str]]:
    """(check id, line, severity) of every finding."""
    return [(p.field, p.line, p.severity) for p in check_entry_source(textwrap.dedent(source), Path(name))]


# --- TOOLS.md's examples: no findings ---------------------------------------------------------

SPEC_QUICK_START = """
type ToolResult = {
  content: Array<{ type: string; text: string }>;
  isError?: boolean;
};

type Params = {
  name: string;
};

export async function execute(
  _toolCallId: string,
  params: Params,
): Promise<ToolResult> {
  return { content: [{ type: 'text', text: `Hello, ${params.name}!` }] };
}
"""

SPEC_INDEX_FORMAT = """
type ToolResult = {
  content: Array<{ type: string; text: string }>;
  isError?: boolean;
};

type OnUpdate = (partial: { content: Array<{ type: string; text: string }> }) => void;

export async function execute(
  toolCallId: string,
  params: Record<string, unknown>,
  signal?: AbortSignal,
  onUpdate?: OnUpdate,
): Promise<ToolResult> {
  // Implementation here
}
"""

SPEC_HELPERS = """
function ok(text: string): ToolResult {
  return { content: [{ type: 'text', text }] };
}

function err(text: string): ToolResult {
  return { content: [{ type: 'text', text }], isError: true };
}
"""

# Recommended Helpers + Typed Parameters, with the Progress Updates snippet as execute's body.
SPEC_HELPERS_TYPED_PROGRESS = SPEC_HELPERS + """
type Params = {
  query: string;
  max_results?: number;
  format?: string;
};

export async function execute(
  _toolCallId: string,
  params: Params,
  _signal?: AbortSignal,
  onUpdate?: OnUpdate,
): Promise<ToolResult> {
  const { query, max_results = 10 } = params;
  onUpdate?.({ content: [{ type: 'text', text: 'Phase 1: Downloading data...' }] });
  // ... do work ...
  onUpdate?.({ content: [{ type: 'text', text: 'Phase 2: Processing 500 files...' }] });
  // ... do work ...
  return ok('Done! Processed 500 files.');
}
"""

SPEC_ERROR_HANDLING = SPEC_HELPERS + """
export async function execute(_toolCallId: string, params: Params): Promise<ToolResult> {
  try {
    // ... implementation ...
    return ok('Success');
  } catch (e) {
    return err(`Failed: ${e instanceof Error ? e.message : String(e)}`);
  }
}
"""

# Missing configuration, Large Output, OFFICER_RESOURCES, Referencing Local Files and
# External Dependencies, as one tool.
SPEC_OTHER_SNIPPETS = SPEC_HELPERS + """
import { execSync, execFileSync } from 'node:child_process';
import { writeFileSync } from 'node:fs';
import { dirname, join } from 'node:path';
import { fileURLToPath } from 'node:url';

// Works in both ESM and CJS contexts
const TOOL_DIR = typeof __dirname !== 'undefined'
  ? __dirname
  : dirname(fileURLToPath(import.meta.url));
const BIN_DIR = join(TOOL_DIR, 'bin');

function hasCommand(cmd: string): boolean {
  try {
    execSync(`which ${cmd}`, { stdio: 'ignore' });
    return true;
  } catch {
    return false;
  }
}

export async function execute(_toolCallId: string, params: Params): Promise<ToolResult> {
  const token = params.api_token ?? process.env.OFFICER_APIFY_TOKEN;
  if (!token) {
    return err('Apify API token not configured. Ask the user to add it in Settings → Integrations.');
  }
  const resources = JSON.parse(process.env.OFFICER_RESOURCES ?? '{}');
  const ocrConfig = resources['optical-character-recognition'];
  if (!hasCommand('python3')) {
    return err('python3 is required but not installed in the container.');
  }
  const items = [execFileSync('python3', [join(BIN_DIR, 'process.py'), inputPath])];
  if (params.output_path) {
    writeFileSync(params.output_path, JSON.stringify(items, null, 2));
    return ok(`${items.length} items saved to ${params.output_path}`);
  }
  return ok(String(ocrConfig));
}
"""

SPEC_COMMON_MISTAKES_CORRECT = """
export async function execute(_id: string, params: Params): Promise<ToolResult> {
  return { content: [{ type: 'text', text: 'result' }] };
}
"""

SPEC_FULL_EXAMPLE = r"""
import { execFileSync } from 'node:child_process';
import { existsSync } from 'node:fs';

type ToolResult = {
  content: Array<{ type: string; text: string }>;
  isError?: boolean;
};

type Params = {
  action: string;
  sql?: string;
  limit?: number;
};

const DB_PATH = process.env.MY_DB_PATH ?? '/officer/data/my.db';

function ok(text: string): ToolResult {
  return { content: [{ type: 'text', text }] };
}

function err(text: string): ToolResult {
  return { content: [{ type: 'text', text }], isError: true };
}

function queryJson(sql: string): Record<string, unknown>[] {
  const output = execFileSync('sqlite3', ['-json', DB_PATH], {
    input: sql,
    encoding: 'utf-8',
    timeout: 10000,
  });
  const trimmed = output.trim();
  if (!trimmed) return [];
  return JSON.parse(trimmed);
}

export async function execute(_toolCallId: string, params: Params): Promise<ToolResult> {
  if (!existsSync(DB_PATH)) {
    return err(`Database not found at ${DB_PATH}.`);
  }

  try {
    switch (params.action) {
      case 'query': {
        if (!params.sql) return err('sql parameter is required for query action.');
        if (!params.sql.trim().toLowerCase().startsWith('select')) {
          return err('Only SELECT statements are allowed.');
        }
        const limit = params.limit ? ` LIMIT ${params.limit}` : '';
        const rows = queryJson(`${params.sql}${limit}`);
        if (rows.length === 0) return ok('No results.');
        const text = rows.map((r, i) => {
          const fields = Object.entries(r).map(([k, v]) => `${k}: ${v ?? ''}`).join(' | ');
          return `${i + 1}. ${fields}`;
        }).join('\n');
        return ok(`${rows.length} results:\n\n${text}`);
      }

      case 'stats': {
        const tables = queryJson("SELECT name FROM sqlite_master WHERE type='table'");
        const lines = tables.map((t) => {
          const count = queryJson(`SELECT COUNT(*) as c FROM "${t.name}"`);
          return `${t.name}: ${(count[0]?.c as number) ?? 0} rows`;
        });
        return ok(`Tables:\n${lines.join('\n')}`);
      }

      default:
        return err(`Unknown action: "${params.action}". Available: query, stats.`);
    }
  } catch (e) {
    return err(`Database error: ${e instanceof Error ? e.message : String(e)}`);
  }
}
"""


@pytest.mark.parametrize("source", [
    SPEC_QUICK_START, SPEC_INDEX_FORMAT, SPEC_HELPERS_TYPED_PROGRESS, SPEC_ERROR_HANDLING, SPEC_OTHER_SNIPPETS,
    SPEC_COMMON_MISTAKES_CORRECT, SPEC_FULL_EXAMPLE,
], ids=["quick-start", "index-format", "helpers-typed-progress", "error-handling", "other-snippets",
        "common-mistakes-correct", "full-example"])
def test_the_specs_own_examples_have_no_findings(source: str) -> None:
    assert findings(source) == []


def test_the_shipped_seed_tool_has_no_findings() -> None:
    assert check_entry_file(REPO / "seed" / "tools" / "hello" / "index.ts") == []


# --- TOOLS.md's wrong examples: flagged --------------------------------------------------------

def test_spec_wrong_class_pattern() -> None:
    assert findings("// ❌ Wrong — class pattern\nexport class MyTool { async run() { ... } }\n") == [
        ("class-pattern", 2, "error")]


def test_spec_wrong_cli_entry_point() -> None:
    assert findings("// ❌ Wrong — CLI entry point\nif (require.main === module) { main(); }\n") == [
        ("execute-export", 1, "error"), ("cli-entry-point", 2, "error")]


def test_spec_wrong_console_log_instead_of_return() -> None:
    source = """
        // ❌ Wrong — console.log instead of return
        export async function execute(_id: string, params: Params) {
          console.log('result');  // Agent never sees this
        }
        """
    # Printing stays a warning; never returning a ToolResult is an error (issue 14).
    assert findings(source) == [("no-return", 3, "error"), ("console-log", 4, "warning")]


# --- execute export ----------------------------------------------------------------------------

@pytest.mark.parametrize("source", [
    "export async function execute() { return ok('x'); }",
    "export function execute() { return ok('x'); }",
    "export const execute = async () => ok('x');",
    "export const execute: Execute = async (_id, p) => { return ok(p.x); };",
    "async function execute() { return ok('x'); }\nexport { execute };",
    "async function run() { return ok('x'); }\nexport { run as execute };",
    "export { execute } from './impl';",
    "export * from './impl';",
    "export class Helper {}\nexport async function execute() { return ok('x'); }",
])
def test_execute_exports_that_work(source: str) -> None:
    assert findings(source) == []


# CommonJS exports of an object with execute run in sandboxd but not in pi's own loader: a warning.
@pytest.mark.parametrize(("source", "line"), [
    ("exports.execute = async function (_id, p) { return ok(p.x); };", 1),
    ("module.exports.execute = async () => ok('x');", 1),
    ("exports['execute'] = async () => ok('x');", 1),
    ("async function execute() { return ok('x'); }\nmodule.exports = { execute };", 2),
    ("module.exports = { async execute(_id, p) { return ok(p.x); } };", 1),
    ("module.exports = { execute: async () => ok('x') };", 1),
    ("module.exports = require('./impl');", 1),
    ("export = { execute: async () => ok('x') };", 1),
])
def test_commonjs_exports_work_here_but_warn(source: str, line: int) -> None:
    [problem] = check_entry_source(source, Path("index.js"))
    assert (problem.field, problem.line, problem.severity) == ("module-exports", line, "warning")
    assert "pi's own loader" in problem.message and "export async function execute" in problem.fix


@pytest.mark.parametrize(("source", "check", "fragment"), [
    ("", "execute-export", "does not export a function named execute"),
    ("export async function run() {}", "execute-export", "does not export a function named execute"),
    ("async function execute() {}", "execute-export", "execute is defined but not exported"),
    ("// export async function execute() {}\nconst s = 'export function execute() {}';", "execute-export",
     "does not export"),
    ("export default function execute() {}", "execute-export", "execute is the default export"),
    ("export default { execute() {} }", "execute-export", "a property of the default export"),
    ("export default function main() {}", "execute-export", "a default export but no export named execute"),
    ("export class MyTool { async execute() {} }", "class-pattern", "exports class MyTool"),
    ("export default class { run() {} }", "class-pattern", "class"),
    ("class SearchTool { async execute() {} }\nmodule.exports = SearchTool;", "class-pattern",
     "module.exports is set to the class SearchTool"),
    ("module.exports = class { run() {} };", "class-pattern", "module.exports is set to a class"),
    ("module.exports = async function (id, p) {};", "module-exports", "set to a function"),
    ("module.exports = (id, p) => ({ content: [] });", "module-exports", "set to a function"),
    ("module.exports = { run() {} };", "module-exports", "an object without execute"),
    # Issue 29: what the shim refuses at every call ("sets module.exports to a function (execute)").
    ("async function execute(id, p) { return ok('x'); }\nmodule.exports = execute;", "module-exports",
     "module.exports is set to the function execute, so there is no execute export"),
    ("const run = async (id, p) => ok('x');\nmodule.exports = run;", "module-exports",
     "set to the function run"),
    ("function execute() { return ok('x'); }\nexport = execute;", "module-exports", "export = is set to the function"),
])
def test_missing_execute_export_is_an_error(source: str, check: str, fragment: str) -> None:
    [problem] = check_entry_source(source, Path("index.ts"))
    assert (problem.field, problem.severity) == (check, "error")
    assert fragment in problem.message and "export async function execute" in problem.fix


# --- CLI entry point -----------------------------------------------------------------------------

@pytest.mark.parametrize(("source", "line"), [
    ("export async function execute() { return ok(''); }\n\nif (require.main === module) main();", 3),
    ("export async function execute() { return ok(''); }\nif (module === require.main) main();", 2),
    ("const [, , city] = process.argv;\nexport async function execute() { return ok(city); }", 1),
    ("if (import.meta.main) { run(); }\nexport async function execute() { return ok(''); }", 1),
])
def test_cli_entry_point_is_a_warning_next_to_an_execute_export(source: str, line: int) -> None:
    assert findings(source) == [("cli-entry-point", line, "warning")]


def test_cli_entry_point_without_execute_is_an_error() -> None:
    assert ("cli-entry-point", 1, "error") in findings("main(process.argv.slice(2));")


@pytest.mark.parametrize("source", [
    # process.argv inside a function is not read at load time; a string or comment is not code.
    "export async function execute() { const argv = process.argv; return ok(String(argv.length)); }",
    "export async function execute() { return ok('if (require.main === module) main()'); }\n"
    "// if (require.main === module) main();",
    "const usage = `process.argv`;\nexport async function execute() { return ok(usage); }",
])
def test_no_cli_entry_point(source: str) -> None:
    assert findings(source) == []


# --- console.log -----------------------------------------------------------------------------------

def test_every_print_inside_execute_is_flagged() -> None:
    source = """
        export async function execute(_id: string, p: Params): Promise<ToolResult> {
          console.log(p);
          items.forEach((item) => console.info(item));
          process.stdout.write('done');
          return ok('done');
        }
        """
    assert findings(source) == [("console-log", 3, "warning"), ("console-log", 4, "warning"),
                                ("console-log", 5, "warning")]


def test_prints_outside_execute_and_console_error_are_fine() -> None:
    source = """
        function debug(x: unknown) { console.log(x); }
        console.log('loaded');
        export async function execute(): Promise<ToolResult> {
          console.error('debugging output');
          console.warn('also fine');
          logger.console.log('not the global console');
          return ok("console.log('in a string')");
        }
        """
    assert findings(source) == []


# --- Bun -----------------------------------------------------------------------------------------

@pytest.mark.parametrize(("source", "fragment"), [
    ("export async function execute() { await Bun.sleep(10); return ok(''); }", "Bun.sleep"),
    ("const f = Bun.file('x');\nexport async function execute() { return ok(''); }", "Bun.file"),
    ("import { Database } from 'bun:sqlite';\nexport async function execute() { return ok(''); }", "'bun:sqlite'"),
    ("const { spawn } = require('bun');\nexport async function execute() { return ok(''); }", "'bun'"),
])
def test_bun_apis_are_errors(source: str, fragment: str) -> None:
    [problem] = check_entry_source(source, Path("index.ts"))
    assert (problem.field, problem.severity) == ("bun-api", "error")
    assert fragment in problem.message and "fs.readFileSync" in problem.fix


def test_bun_behind_a_typeof_guard_is_a_warning() -> None:
    source = ("export async function execute() {\n"
              "  const text = typeof Bun !== 'undefined' ? await Bun.file('x').text() : readFileSync('x', 'utf8');\n"
              "  return ok(text);\n}")
    assert findings(source) == [("bun-api", 2, "warning")]


@pytest.mark.parametrize("source", [
    "export async function execute() { return ok('Bun.file is not available'); }",
    "// Bun.sleep(1) would not work here\nexport async function execute() { return ok(''); }",
    "export async function execute() { return ok(config.Bun.name); }",
    "import { x } from 'bunyan';\nexport async function execute() { return ok(x); }",
])
def test_no_bun(source: str) -> None:
    assert findings(source) == []


# --- throw ---------------------------------------------------------------------------------------

def test_throws_that_escape_execute_are_warnings() -> None:
    source = """
        export async function execute(_id: string, p: Params): Promise<ToolResult> {
          if (!p.city) throw new Error('city is required');
          try {
            throw new Error('caught below');
          } catch (e) {
            throw e;
          } finally {
            cleanUp();
          }
        }
        """
    assert findings(source) == [("throw", 3, "warning"), ("throw", 7, "warning")]


def test_throws_inside_try_or_in_other_functions_are_fine() -> None:
    source = """
        function check(x: string) { if (!x) throw new Error('empty'); }
        export const execute = async (_id: string, p: Params): Promise<ToolResult> => {
          try {
            check(p.city);
            if (p.x) { throw new Error('inside try'); }
            const parsed = JSON.parse(p.raw, (k, v) => { if (k === 'bad') throw new Error(k); return v; });
            return ok(String(parsed));
          } catch (e) {
            try { throw e; } catch { return err('nested try'); }
          }
        };
        const notes = 'throw new Error(x)';  // a throw in text
        """
    assert findings(source) == []


def test_throw_in_an_execute_exported_by_another_name() -> None:
    source = "async function run(): Promise<ToolResult> {\n  throw new Error('x');\n}\nexport { run as execute };"
    assert findings(source) == [("throw", 2, "warning")]


def test_throw_in_a_module_exports_method() -> None:
    source = "module.exports = {\n  async execute(_id, p) {\n    throw new Error('x');\n  },\n};"
    assert findings(source, "index.js") == [("module-exports", 1, "warning"), ("throw", 3, "warning")]


def test_typescript_features_do_not_confuse_the_structure() -> None:
    source = """
        enum Mode { Fast = 'fast', Slow = 'slow' }
        interface Options { mode: Mode; limits: { max: number } }
        @sealed class Cache<T extends object> { private items = new Map<string, T>(); get(k: string): T | undefined { return this.items.get(k); } }
        export async function execute<T>(_id: string, p: { mode: Mode }): Promise<{ content: Array<{ type: string; text: string }> }> {
          const xs: Array<Array<number>> = [[1]];
          if (!xs.length) throw new Error('empty');
          return { content: [{ type: 'text', text: `${p.mode satisfies Mode}` }] };
        }
        """
    assert findings(source) == [("throw", 7, "warning")]


def test_unreadable_and_non_utf8_entry_files(tmp_path: Path) -> None:
    latin = tmp_path / "index.ts"
    latin.write_bytes(b"export async function execute() {}\n// caf\xe9\n")
    [problem] = check_entry_file(latin)
    assert problem.line == 2 and "not UTF-8" in problem.message
    [missing] = check_entry_file(tmp_path / "nope.ts")
    assert "cannot read" in missing.message


# --- bump version ------------------------------------------------------------------------------

def write_tool(root: Path, version: int, source: str = "export async function execute() { return ok('1'); }") -> Path:
    tool = root / "weather"
    tool.mkdir(parents=True, exist_ok=True)
    (tool / "TOOL.md").write_text(f"---\nname: weather\ndescription: Weather.\nversion: {version}\n---\n# Weather\n")
    (tool / "index.ts").write_text(source)
    return tool


def test_an_edit_without_a_bump_is_flagged(tmp_path: Path) -> None:
    data = tmp_path / "data"
    write_tool(data / "tools", 2)
    seed_tool = write_tool(tmp_path / "seed", 2, "export async function execute() { return ok('2'); }")
    [problem] = check_synced_copy(seed_tool, data)
    assert (problem.path, problem.line, problem.field, problem.severity) == (
        seed_tool / "TOOL.md", 4, "version", "error")
    assert "same version 2" in problem.message and problem.fix == "bump the version: 'version: 3'"


def test_a_lower_version_than_the_synced_copy_is_flagged(tmp_path: Path) -> None:
    data = tmp_path / "data"
    write_tool(data / "tools", 5)
    seed_tool = write_tool(tmp_path / "seed", 4, "export async function execute() { return ok('2'); }")
    [problem] = check_synced_copy(seed_tool, data)
    assert "has version 5, higher than this tool's 4" in problem.message and "'version: 6'" in problem.fix


def test_an_extra_file_counts_as_a_change(tmp_path: Path) -> None:
    data = tmp_path / "data"
    write_tool(data / "tools", 1)
    seed_tool = write_tool(tmp_path / "seed", 1)
    assert check_synced_copy(seed_tool, data) == []
    (seed_tool / "bin").mkdir()
    (seed_tool / "bin" / "helper.py").write_text("print(1)\n")
    assert len(check_synced_copy(seed_tool, data)) == 1


@pytest.mark.parametrize("case", ["same-content", "bumped", "not-installed", "inside-data-path"])
def test_no_bump_needed(tmp_path: Path, case: str) -> None:
    data = tmp_path / "data"
    installed = write_tool(data / "tools", 1)
    if case == "not-installed":
        (installed / "TOOL.md").unlink()
        (installed / "index.ts").unlink()
        installed.rmdir()
    version = 2 if case == "bumped" else 1
    source = "export async function execute() { return ok('1'); }" if case == "same-content" else "// changed"
    tool = write_tool(data / "alice@example.com" / "tools" if case == "inside-data-path" else tmp_path / "seed",
                      version, source)
    assert check_synced_copy(tool, data) == []


@pytest.mark.usefixtures("isolated_config")
def test_validate_cli_reports_code_and_bump_findings_as_json(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    data = tmp_path / "data"
    write_tool(data / "tools", 1)
    tool = write_tool(tmp_path / "seed", 1, "export class Weather {}\n")
    code = main(["validate", "--json", "--data-path", str(data), str(tool)])
    report = json.loads(capsys.readouterr().out)
    assert code == 1 and (report["errors"], report["warnings"]) == (2, 0)
    assert [(p["field"], p["line"], Path(p["path"]).name) for p in report["problems"]] == [
        ("class-pattern", 1, "index.ts"), ("version", 4, "TOOL.md")]


def test_validate_paths_checks_code_in_every_tool_of_a_root(tmp_path: Path) -> None:
    write_tool(tmp_path / "tools", 1, "export function run() {}")
    problems = validate_paths([tmp_path / "tools"])
    assert [(p.field, p.path.name) for p in problems] == [("execute-export", "index.ts")]


# --- robustness --------------------------------------------------------------------------------

_FRAGMENTS = st.sampled_from([
    "export ", "async ", "function ", "execute", "(", ")", "{", "}", "[", "]", "'", '"', "`", "${", "/", "*", "\\",
    "\n", " ", "=>", "=", ";", ":", ",", ".", "<", ">", "throw ", "try ", "catch ", "class ", "module", "exports",
    "require", "main", "process", "argv", "console", "log", "Bun", "//", "/*", "*/", "default ", "x", "1",
])


@settings(max_examples=300, deadline=None)
@given(st.lists(_FRAGMENTS, max_size=60).map("".join))
def test_any_source_is_checked_without_raising(source: str) -> None:
    for problem in check_entry_source(source, Path("index.ts")):
        assert problem.line is not None and problem.line >= 1 and problem.fix


def test_missing_version_is_a_warning_and_a_version_is_not(tmp_path: Path) -> None:
    tool = write_tool(tmp_path, 1)
    assert validate_paths([tool]) == []
    (tool / "TOOL.md").write_text("---\nname: weather\ndescription: Weather.\n---\n# Weather\n")
    [problem] = validate_paths([tool])
    assert (problem.field, problem.severity) == ("version", "warning") and "'version: 1'" in problem.fix


# --- issue 14: the misses of the hand-written tokenizer, now on a syntax tree ---------------------

def test_an_execute_that_never_returns_is_an_error() -> None:
    source = "export async function execute(_id: string, p: Params) {\n  const x = p.city;\n  doWork(x);\n}\n"
    [problem] = check_entry_source(source, Path("index.ts"))
    assert (problem.field, problem.line, problem.severity) == ("no-return", 1, "error")
    assert "never returns a ToolResult" in problem.message and "return { content:" in problem.fix


def test_a_bare_return_is_not_a_result() -> None:
    assert findings("export function execute() {\n  if (x) { return; }\n  work();\n}") == [("no-return", 1, "error")]


@pytest.mark.parametrize(("source", "line"), [
    ("export async function execute(_id, p) {\n  if (p.x) {\n    return ok('x');\n  }\n}", 5),
    ("export const execute = async (_id, p) => {\n  switch (p.a) {\n    case 'a': return ok('a');\n  }\n};", 5),
    ("export async function execute(_id, p) {\n  try {\n    return ok(await f());\n  } catch (e) {\n"
     "    console.error(e);\n  }\n}", 7),
    ("export async function execute(_id, p) {\n  for (const x of p.xs) { if (x) return ok(x); }\n}", 3),
])
def test_a_path_that_ends_without_a_return_is_an_error(source: str, line: int) -> None:
    assert findings(source) == [("implicit-return", line, "error")]


@pytest.mark.parametrize("entry", ["index.js", "index.ts"])
def test_module_exports_set_to_execute_fails_validate(tmp_path: Path, entry: str,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    """Issue 29: `module.exports = execute` was a warning saying "sandboxd runs it"; the shim refuses it."""
    tool = tmp_path / "weather"
    tool.mkdir()
    (tool / "TOOL.md").write_text("---\nname: weather\ndescription: Weather.\nversion: 1\n---\n# weather\n")
    (tool / entry).write_text("async function execute(_id, params) {\n"
                              "  return { content: [{ type: 'text', text: 'sunny' }] };\n}\nmodule.exports = execute;\n")
    assert main(["validate", str(tool)]) == 1
    out = capsys.readouterr().out
    assert f"{tool}/{entry}:4: error: module-exports: module.exports is set to the function execute" in out, out
    assert "sandboxd runs it" not in out and out.endswith("1 error, 0 warnings\n")


def test_a_success_path_that_falls_off_the_end_fails_validate(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Issue 29: the error branches return, the success path does not, so every successful call
    fails with "execute returned undefined"; validate must exit 1."""
    tool = tmp_path / "weather"
    tool.mkdir()
    (tool / "TOOL.md").write_text("---\nname: weather\ndescription: Weather.\nversion: 1\n---\n# weather\n")
    (tool / "index.ts").write_text(
        "export async function execute(_id: string, params: { city?: string }) {\n"
        "  if (!params.city) return { content: [{ type: 'text', text: 'no city' }], isError: true };\n"
        "  const answer = `sunny in ${params.city}`;\n"
        "}\n")
    assert main(["validate", str(tool)]) == 1
    out = capsys.readouterr().out
    assert f"{tool}/index.ts:4: error: implicit-return: " in out and "execute returned undefined" in out, out
    assert out.endswith("1 error, 0 warnings\n")


@pytest.mark.parametrize("source", [
    "export async function execute(_id, p) {\n  if (p.x) return ok('x');\n  else return err('y');\n}",
    "export async function execute(_id, p) {\n  switch (p.a) {\n    case 'a': return ok('a');\n"
    "    default: return err('no');\n  }\n}",
    "export async function execute(_id, p) {\n  while (true) {\n    if (await done()) return ok('done');\n  }\n}",
    "export async function execute(_id, p) {\n  try { return ok(f()); } finally { cleanUp(); }\n}",
    "export async function execute(_id, p) {\n  const xs = p.xs.map((x) => { console.error(x); });\n  return ok(String(xs));\n}",
    "export const execute = async () => ({ content: [] });",
])
def test_every_path_returns(source: str) -> None:
    assert findings(source) == []


def test_module_exports_object_with_execute_warns_with_the_fix() -> None:
    source = "async function execute(_id, p) { return ok(p.x); }\nmodule.exports = { execute };\n"
    [problem] = check_entry_source(source, Path("index.js"))
    assert (problem.field, problem.line, problem.severity) == ("module-exports", 2, "warning")
    assert problem.fix == EXPORT_FIX


def test_a_generic_arrow_execute_is_examined() -> None:
    source = "export const execute = async <T,>(_id: string, p: T) => {\n  throw new Error('x');\n};\n"
    assert findings(source) == [("throw", 2, "warning")]
    tsx = "export const execute = async <T,>(_id: string, p: T) => {\n  console.log(p);\n  return ok('');\n};\n"
    assert findings(tsx, "index.tsx") == [("console-log", 2, "warning")]


@pytest.mark.parametrize("source", [
    # Code that merely mentions the patterns in strings, templates, regexes and comments.
    "export async function execute() {\n  const s = 'console.log(x); Bun.file(y); throw z';\n"
    "  const t = `console.log(${1}) Bun.file( throw new Error()`;\n  const r = /console\\.log\\(|Bun\\.file\\(|throw/g;\n"
    "  /* console.log('x'); throw new Error(); */\n  return ok(s + t + r.source);\n}",
    "export async function execute() {\n  const r = /`/; const q = '`';\n  return ok(`${r.source}${q} console.log(`);\n}",
    "export async function execute() {\n  const t = `${`${'throw'}`} throw`;\n  return ok(t);\n}",
    # A division followed by a slash-y line must not open a regex that swallows code.
    "const half = total / 2; const q = a / b;\nexport async function execute() { return ok(String(half / q)); }",
])
def test_mentions_in_literals_are_not_code(source: str) -> None:
    assert findings(source) == []


def test_re_exports_are_followed_to_the_local_function() -> None:
    source = ("async function run(_id: string, p: Params) {\n  console.log(p);\n}\n"
              "export { run as execute };\n")
    assert findings(source) == [("no-return", 1, "error"), ("console-log", 2, "warning")]
    via_const = "const run = async () => { throw new Error('x'); };\nconst alias = run;\nexport { alias as execute };"
    assert findings(via_const) == [("throw", 1, "warning")]


def test_type_only_exports_do_not_count_as_execute() -> None:
    source = "type execute = () => void;\nexport type { execute };\n"
    assert [p[0] for p in findings(source)] == ["execute-export"]


def test_export_fix_is_the_shims_hint(tmp_path: Path) -> None:
    """One source for the fix text: the shim's load-time error ends with the linter's EXPORT_FIX."""
    import shutil
    import subprocess
    node = shutil.which("node")
    assert node, "node is needed to load the shim's result.js"
    script = ("const { resolveExecute } = require(process.argv[1]);"
              "try { resolveExecute({ run() {} }, 'index.ts'); } catch (e) { process.stdout.write(e.message); }")
    shim = REPO / "images" / "node" / "shim" / "src" / "result.js"
    message = subprocess.run([node, "-e", script, str(shim)], capture_output=True, text=True, check=True).stdout
    assert message.endswith("; " + EXPORT_FIX), message


@pytest.mark.parametrize("block", ["if (a) {", "if (a) { return ok('') } else {", "x(() => {"])
def test_hostile_nesting_is_checked_without_raising(block: str) -> None:
    depth = 5000
    closer = "})" if block.startswith("x(") else "}"
    source = "export async function execute() {\n" + block * depth + "work();" + closer * depth + "\n}\n"
    for problem in check_entry_source(source, Path("index.ts")):
        assert problem.field in ("no-return", "implicit-return") and problem.line is not None


# --- re-exports from the tool's other modules are followed ---------------------------------------

IMPL_NO_RETURN = "export async function execute(_id: string, p: Params) {\n  console.log(p.city);\n}\n"


@pytest.mark.parametrize(("entry", "impl_name"), [
    ("export { execute } from './impl';\n", "impl.ts"),
    ("export { execute } from './impl.js';\n", "impl.ts"),  # TypeScript's ESM spelling of impl.ts
    ("export * from './lib';\n", "lib/index.ts"),
    ("import { execute as run } from './impl';\nexport { run as execute };\n", "impl.ts"),
])
def test_an_execute_re_exported_from_a_module_of_the_tool_is_checked_there(tmp_path: Path, entry: str,
                                                                           impl_name: str) -> None:
    (tmp_path / "index.ts").write_text(entry)
    impl = tmp_path / impl_name
    impl.parent.mkdir(parents=True, exist_ok=True)
    impl.write_text(IMPL_NO_RETURN)
    assert [(p.path, p.field, p.line) for p in check_entry_file(tmp_path / "index.ts")] == [
        (impl, "no-return", 1), (impl, "console-log", 2)]


def test_re_exports_are_followed_through_several_modules(tmp_path: Path) -> None:
    (tmp_path / "index.ts").write_text("export { run as execute } from './a';\n")
    (tmp_path / "a.ts").write_text("export { go as run } from './b';\n")
    (tmp_path / "b.ts").write_text("function go() {\n  throw new Error('x');\n}\nexport { go };\n")
    assert [(p.path.name, p.field, p.line) for p in check_entry_file(tmp_path / "index.ts")] == [("b.ts", "throw", 2)]


def test_re_exports_stay_inside_the_tool_and_survive_cycles(tmp_path: Path) -> None:
    tool = tmp_path / "tool"
    tool.mkdir()
    (tmp_path / "outside.ts").write_text(IMPL_NO_RETURN)
    (tool / "index.ts").write_text("export { execute } from '../outside';\n")
    assert check_entry_file(tool / "index.ts") == []
    (tool / "link.ts").symlink_to(tmp_path / "outside.ts")
    (tool / "index.ts").write_text("export { execute } from './link';\n")
    assert check_entry_file(tool / "index.ts") == []
    (tool / "index.ts").write_text("export { execute } from './a';\n")
    (tool / "a.ts").write_text("export { execute } from './b';\n")
    (tool / "b.ts").write_text("export { execute } from './a';\n")
    assert check_entry_file(tool / "index.ts") == []
