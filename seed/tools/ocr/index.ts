import { execFileSync } from 'node:child_process';
import { closeSync, existsSync, mkdtempSync, openSync, readSync, readdirSync, realpathSync, rmSync, statSync, writeFileSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { basename, dirname, join, resolve } from 'node:path';

type ToolResult = { content: Array<{ type: string; text: string }>; isError?: boolean };
type OnUpdate = (partial: { content: Array<{ type: string; text: string }> }) => void;
type Params = { image_path: string; page?: number; lang?: string; output_path?: string };

const USER_ROOT = '/officer/user';

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

// A path given to the tool must stay in the user's folder, links resolved first (a link
// inside /officer/user pointing out of it is refused too).
function userPath(param: string, value: string, mustExist: boolean): string {
  const fix = `Fix: use a path inside ${USER_ROOT}, e.g. ${USER_ROOT}/result.json`;
  const inside = (p: string) => p === USER_ROOT || p.startsWith(USER_ROOT + '/');
  const abs = resolve(USER_ROOT, value);
  if (!inside(abs)) throw new Error(`${param} must be inside ${USER_ROOT}, got ${value}. ${fix}`);
  if (mustExist && !existsSync(abs)) throw new Error(`${param}: no such file: ${abs}. Fix: check the path (list ${USER_ROOT} to see what is there).`);
  if (!existsSync(dirname(abs))) throw new Error(`${param}: the folder ${dirname(abs)} does not exist. Fix: write into an existing folder such as ${USER_ROOT}.`);
  const real = existsSync(abs) ? realpathSync(abs) : join(realpathSync(dirname(abs)), basename(abs));
  if (!inside(real)) throw new Error(`${param} must be inside ${USER_ROOT}, got ${value}, which resolves to ${real} through a link. ${fix}`);
  return real;
}

function run(cmd: string, args: string[], what: string): string {
  try {
    return execFileSync(cmd, args, { encoding: 'utf-8', timeout: 120_000, stdio: ['ignore', 'pipe', 'pipe'], maxBuffer: 64 * 1024 * 1024 });
  } catch (e) {
    const why = String((e as { stderr?: string }).stderr || (e as Error).message).trim().split('\n').slice(-3).join(' ');
    throw new Error(`${what} (${why}).`);
  }
}

function isPdf(path: string): boolean {
  const head = Buffer.alloc(5);
  const fd = openSync(path, 'r');
  try {
    readSync(fd, head, 0, 5, 0);
  } finally {
    closeSync(fd);
  }
  return head.toString('latin1') === '%PDF-';
}

export async function execute(
  _toolCallId: string,
  params: Params,
  _signal?: AbortSignal,
  onUpdate?: OnUpdate,
): Promise<ToolResult> {
  const scratch = mkdtempSync(join(tmpdir(), 'ocr-'));
  try {
    if (!hasCommand('tesseract')) return err('tesseract is not installed in the sandbox (the runner image should carry it); tell the user.');
    const input = userPath('image_path', params.image_path, true);
    if (!statSync(input).isFile()) return err(`image_path ${input} is not a file.`);
    const out = params.output_path ? userPath('output_path', params.output_path, false) : undefined;
    const lang = params.lang ?? 'eng';
    const installed = run('tesseract', ['--list-langs'], 'tesseract could not list its languages')
      .split('\n').slice(1).map((l) => l.trim()).filter(Boolean);
    const missing = lang.split('+').filter((l) => !installed.includes(l));
    if (missing.length) return err(`language ${missing.join(', ')} is not installed for tesseract. Installed: ${installed.join(', ')}.`);

    let image = input;
    let text: string | undefined;
    if (isPdf(input)) {
      if (!hasCommand('pdftoppm')) return err('pdftoppm (poppler-utils) is needed for PDFs but is not installed in the sandbox; tell the user.');
      const page = params.page ?? 1;
      const info = run('pdfinfo', [input], `${input} is not a PDF poppler can read`);
      const pages = Number(/^Pages:\s+(\d+)/m.exec(info)?.[1] ?? 0);
      if (!Number.isInteger(page) || page < 1 || page > pages) return err(`page ${params.page} is out of range: ${input} has ${pages} page(s).`);
      const layer = run('pdftotext', ['-f', String(page), '-l', String(page), '-layout', input, '-'], `could not read the text of ${input}`);
      if (layer.trim()) {
        text = layer;
      } else {
        onUpdate?.({ content: [{ type: 'text', text: `Page ${page} has no text layer; rendering it at 300 dpi for OCR…` }] });
        run('pdftoppm', ['-f', String(page), '-l', String(page), '-r', '300', '-png', input, join(scratch, 'page')], `could not render page ${page} of ${input}`);
        image = join(scratch, readdirSync(scratch).find((f) => f.endsWith('.png'))!);
      }
    }
    if (text === undefined) {
      onUpdate?.({ content: [{ type: 'text', text: `Running OCR (${lang}) on ${basename(input)}…` }] });
      text = run('tesseract', [image, 'stdout', '-l', lang], `Tesseract could not read ${input}; is it an image (PNG, JPEG, TIFF) or a PDF?`);
    }
    const clean = text.replace(/\f/g, '').replace(/[ \t]+\n/g, '\n').trim();
    if (out) {
      writeFileSync(out, clean + '\n');
      return ok(`Recognised ${clean.length} characters (${clean ? clean.split('\n').length : 0} lines); saved to ${out}.`);
    }
    return ok(clean ? clean : `No text found in ${input}.`);
  } catch (e) {
    return err(e instanceof Error ? e.message : String(e));
  } finally {
    rmSync(scratch, { recursive: true, force: true });
  }
}
