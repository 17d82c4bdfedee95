import { execFileSync, spawn } from 'node:child_process';
import { existsSync, realpathSync, writeFileSync } from 'node:fs';
import { basename, dirname, join, resolve } from 'node:path';

type ToolResult = { content: Array<{ type: string; text: string }>; isError?: boolean };
type Params = {
  action: string; sql?: string; text?: string; limit?: number; output_path?: string; timeout_seconds?: number;
};
type Run = { status: number | null; stdout: string; stderr: string; error?: Error };

const TOOL_DIR = typeof __dirname !== 'undefined' ? __dirname : dirname(new URL(import.meta.url).pathname);
const HELPER = join(TOOL_DIR, 'bin', 'email_db.py');

function ok(text: string): ToolResult {
  return { content: [{ type: 'text', text }] };
}

function err(text: string): ToolResult {
  return { content: [{ type: 'text', text }], isError: true };
}

function hasCommand(cmd: string): boolean {
  try {
    execFileSync('which', [cmd], { stdio: 'ignore' });
    return true;
  } catch {
    return false;
  }
}


// --- the user's folder, and paths confined to it: the same in every seed tool that takes paths
// (each tool folder stands alone, as TOOLS.md asks); tests/unit/test_seed_tools.py keeps the copies equal.
function userRoot(): string {
  return process.env.OFFICER_USER_ROOT || '/officer/user';
}

function userPath(param: string, value: string, mustExist: boolean): string {
  const root = userRoot();
  const fix = `Fix: use a path inside ${root}, e.g. ${root}/result.json`;
  const inside = (p: string) => p === root || p.startsWith(root + '/');
  const abs = resolve(root, value);
  if (!inside(abs)) throw new Error(`${param} must be inside ${root}, got ${value}. ${fix}`);
  if (mustExist && !existsSync(abs)) throw new Error(`${param}: no such file: ${abs}. Fix: check the path (list ${root} to see what is there).`);
  if (!existsSync(dirname(abs))) throw new Error(`${param}: the folder ${dirname(abs)} does not exist. Fix: write into an existing folder such as ${root}.`);
  const real = existsSync(abs) ? realpathSync(abs) : join(realpathSync(dirname(abs)), basename(abs));
  if (!inside(real)) throw new Error(`${param} must be inside ${root}, got ${value}, which resolves to ${real} through a link. ${fix}`);
  return real;
}
// --- end of the user's folder

function count(n: number, one: string, many = `${one}s`): string {
  return `${n} ${n === 1 ? one : many}`;
}

// What to do about an SQL error, by what SQLite said: most are about the SQL itself.
function sqlHint(message: string): string {
  if (/is refused|readonly|read-only/i.test(message)) return 'The email database is read-only: only SELECT statements (and read-only PRAGMAs) run.';
  if (/one statement at a time/i.test(message)) return 'Send one statement per call.';
  return 'See action=schema for the tables and columns.';
}

const MAX_ANSWER_BYTES = 64 * 1024 * 1024; // the helper holds its values to 16 MiB; this is the backstop

// The helper, without blocking the shim: a cancel (the call's AbortSignal) kills it at once. It
// stops itself at its time budget; the kill 5 s later is for a helper that cannot.
function runHelper(input: string, budgetS: number, signal?: AbortSignal): Promise<Run> {
  return new Promise((done) => {
    const child = spawn('python3', [HELPER], { stdio: ['pipe', 'pipe', 'pipe'], signal });
    const out: Buffer[] = [];
    let size = 0;
    let stderr = '';
    let failure: Error | undefined;
    const timer = setTimeout(() => child.kill('SIGKILL'), (budgetS + 5) * 1000);
    child.stdout.on('data', (chunk: Buffer) => {
      size += chunk.length;
      if (size > MAX_ANSWER_BYTES) { failure = new Error('its answer grew past 64 MiB'); child.kill('SIGKILL'); }
      else out.push(chunk);
    });
    child.stderr.on('data', (chunk: Buffer) => { stderr = (stderr + chunk.toString()).slice(-4000); });
    child.on('error', (e) => { failure = failure ?? e; });
    child.on('close', (status) => {
      clearTimeout(timer);
      done({ status, stdout: Buffer.concat(out).toString('utf-8'), stderr, error: failure });
    });
    child.stdin.on('error', () => {}); // a helper that died early: its exit says why
    child.stdin.end(input);
  });
}

function table(columns: string[], rows: Record<string, unknown>[]): string {
  return rows.map((r, i) => `${i + 1}. ` + columns.map((c) => `${c}: ${r[c] ?? ''}`).join(' | ')).join('\n');
}

export async function execute(_toolCallId: string, params: Params, signal?: AbortSignal): Promise<ToolResult> {
  try {
    const db = process.env.OFFICER_EMAIL_DB || '/officer/data/emails.db';
    if (!existsSync(db)) {
      return err(`No email database at ${db}: the user's email has not been synced yet. Ask the user to connect their mailbox.`);
    }
    if (!hasCommand('python3')) return err('python3 is required to read the email database but is not installed in the sandbox.');
    const limit = params.limit ?? 50;
    if (!Number.isInteger(limit) || limit < 1 || limit > 1000) return err(`limit must be a whole number from 1 to 1000, got ${params.limit}.`);
    const budget = params.timeout_seconds ?? 20;
    if (!(budget >= 1 && budget <= 300)) return err(`timeout_seconds must be from 1 to 300, got ${params.timeout_seconds}.`);
    if (params.action === 'query' && !params.sql?.trim()) return err('sql is required for action=query, e.g. "SELECT count(*) FROM messages".');
    if (params.action === 'search' && !params.text) return err('text is required for action=search, e.g. text: "invoice".');
    const out = params.output_path ? userPath('output_path', params.output_path, false) : undefined;

    const run = await runHelper(
      JSON.stringify({ db, action: params.action, sql: params.sql, text: params.text, limit, budget_s: budget }),
      budget, signal);
    if (signal?.aborted) return err('Cancelled: the query was stopped.');
    if (run.error) return err(`Could not run the database helper: ${run.error.message}`);
    if (run.status !== 0) return err(`The database helper failed (exit ${run.status}): ${run.stderr.trim().slice(-2000)}`);
    const res = JSON.parse(run.stdout);
    if (res.error === 'open') return err(`Cannot open the email database at ${db}: ${res.message}. It may be damaged or not an SQLite file.`);
    if (res.error === 'unfinished') return err(`Cannot read the email database at ${db} yet: ${res.message} (the mail sync's next run does). This tool only reads, so it does not; try again later.`);
    if (res.error === 'sql') return err(`SQL error: ${String(res.message).replace(/\.+$/, '')}. ${sqlHint(res.message)}`);
    if (res.error) return err(`Unknown action "${params.action}". Use one of: stats, schema, query, search.`);

    if (out) {
      writeFileSync(out, JSON.stringify(res, null, 2));
      const n = res.rows?.length ?? res.tables?.length ?? res.objects?.length
        ?? res.results?.reduce((a: number, r: { rows: unknown[] }) => a + r.rows.length, 0);
      return ok(`${params.action}: ${count(n, 'item')} saved to ${out}`);
    }
    switch (params.action) {
      case 'stats':
        return ok(`Tables:\n${res.tables.map((t: { table: string; rows: number }) => `${t.table}: ${count(t.rows, 'row')}`).join('\n') || '(none)'}`);
      case 'schema':
        return ok(res.objects.map((o: { sql: string }) => `${o.sql};`).join('\n\n') || '(empty database)');
      case 'query': {
        if (res.rows.length === 0) return ok('No results.');
        const more = res.cut ? `\n\n(${res.cut}: select fewer columns, or add LIMIT/OFFSET)`
          : res.truncated ? `\n\n(more rows exist: raise limit, add LIMIT/OFFSET, or use output_path)` : '';
        return ok(`${count(res.rows.length, 'result')}:\n\n${table(res.columns, res.rows)}${more}`);
      }
      default: {
        if (res.searched.length === 0) return err('No table has a subject, sender, from or body column to search; use action=schema and action=query instead.');
        const parts = res.results.filter((r: { rows: unknown[] }) => r.rows.length > 0).map(
          (r: { table: string; columns: string[]; rows: Record<string, unknown>[]; truncated: boolean }) =>
            `${r.table} (${r.truncated ? `${r.rows.length}+ matches` : count(r.rows.length, 'match', 'matches')}):\n${table(r.columns, r.rows)}`);
        return ok(parts.length ? parts.join('\n\n') : `No messages contain "${params.text}".`);
      }
    }
  } catch (e) {
    return err(e instanceof Error ? e.message : String(e));
  }
}
