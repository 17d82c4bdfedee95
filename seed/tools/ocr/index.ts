import { execFileSync } from 'node:child_process';
import { closeSync, existsSync, mkdtempSync, openSync, readSync, readdirSync, realpathSync, rmSync, statSync, writeFileSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { basename, dirname, join, resolve } from 'node:path';

type ToolResult = { content: Array<{ type: string; text: string }>; isError?: boolean };
type OnUpdate = (partial: { content: Array<{ type: string; text: string }> }) => void;
type Params = { image_path: string; page?: number; lang?: string; output_path?: string };


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

function run(cmd: string, args: string[], what: string): string {
  try {
    return execFileSync(cmd, args, { encoding: 'utf-8', timeout: 120_000, stdio: ['ignore', 'pipe', 'pipe'], maxBuffer: 64 * 1024 * 1024 });
  } catch (e) {
    const why = String((e as { stderr?: string }).stderr || (e as Error).message).trim().split('\n').slice(-3).join(' ');
    throw new Error(`${what} (${why}).`);
  }
}

function head(path: string, bytes = 16): Buffer {
  const buffer = Buffer.alloc(bytes);
  const fd = openSync(path, 'r');
  try {
    return buffer.subarray(0, readSync(fd, buffer, 0, bytes, 0));
  } finally {
    closeSync(fd);
  }
}

// What the file's first bytes say it is: 'pdf', 'image' (a format Tesseract's Leptonica reads),
// or a description of what it is instead. Tesseract takes any other file for a list of image
// names and answers with its bytes quoted back, so the check comes first.
function kindOf(start: Buffer): 'pdf' | 'image' | string {
  const text = start.toString('latin1');
  if (text.startsWith('%PDF-')) return 'pdf';
  const images = [
    [0x89, 0x50, 0x4e, 0x47], [0xff, 0xd8, 0xff], [0x49, 0x49, 0x2a, 0x00], [0x4d, 0x4d, 0x00, 0x2a],
    [0x47, 0x49, 0x46, 0x38], [0x42, 0x4d], [0x00, 0x00, 0x00, 0x0c, 0x6a, 0x50],
  ];
  if (images.some((magic) => magic.every((byte, i) => start[i] === byte))) return 'image';
  if (text.startsWith('RIFF') && text.slice(8, 12) === 'WEBP') return 'image';
  if (/^P[1-7]\s/.test(text)) return 'image'; // PNM
  if (text.startsWith('RIFF') && text.slice(8, 12) === 'WAVE') return 'a WAV audio file';
  if (text.startsWith('ID3') || (start[0] === 0xff && (start[1] & 0xe0) === 0xe0)) return 'an MP3 audio file';
  if (text.slice(4, 8) === 'ftyp') return 'an MP4/M4A audio or video file';
  if (text.startsWith('OggS') || text.startsWith('fLaC')) return 'an audio file';
  if (text.startsWith('PK')) return 'a ZIP archive (an Office document?)';
  if (start.length === 0) return 'empty';
  if (/^[\x09\x0a\x0d\x20-\x7e]*$/.test(text)) return 'text';
  return 'not in an image format Tesseract reads';
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

    const kind = kindOf(head(input));
    if (kind !== 'pdf' && kind !== 'image') {
      return err(`${input} is not an image (it is ${kind}): give a PNG, JPEG, TIFF, GIF, BMP, WebP or PNM image, or a PDF.`);
    }
    let image = input;
    let text: string | undefined;
    if (kind === 'pdf') {
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
