import { execFileSync, spawn } from 'node:child_process';
import { existsSync, realpathSync, writeFileSync } from 'node:fs';
import { basename, dirname, join, resolve } from 'node:path';

type ToolResult = { content: Array<{ type: string; text: string }>; isError?: boolean };
type OnUpdate = (partial: { content: Array<{ type: string; text: string }> }) => void;
type Params = { program?: string; args: string; output_path?: string; timeout_seconds?: number };

const LOG_TAIL_LINES = 20;
const INLINE_STDOUT = 20_000;
// What is kept in memory of each stream: a program that floods stdout or its log
// must not take the sandbox's memory with it.
const KEEP_HEAD = 8 * 1024 * 1024;
const KEEP_TAIL = 64 * 1024;

// A stream's first KEEP_HEAD characters and, past them, its last KEEP_TAIL.
class Capture {
  head = '';
  tail = '';
  dropped = 0;

  add(d: string): void {
    if (this.head.length < KEEP_HEAD) {
      this.head += d;
      return;
    }
    this.dropped += d.length;
    this.tail = (this.tail + d).slice(-KEEP_TAIL);
  }

  text(): string {
    return this.dropped ? `${this.head}\n… (${this.dropped} characters left out) …\n${this.tail}` : this.head;
  }

  last(): string {
    return this.dropped ? this.tail : this.head;
  }
}

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

function parseArgs(raw: string): string[] {
  let args: unknown;
  try {
    args = JSON.parse(raw);
  } catch (e) {
    throw new Error(`args must be a JSON array of strings, e.g. ["-i", "in.wav", "out.mp3"]; could not parse it: ${(e as Error).message}`);
  }
  if (!Array.isArray(args) || !args.every((a) => typeof a === 'string')) {
    throw new Error('args must be a JSON array of strings, e.g. ["-i", "in.wav", "out.mp3"] (numbers as strings too: "128k", "30").');
  }
  return args;
}

function seconds(value: string): number {
  const m = /^(-?\d+):(\d+):(\d+(?:\.\d+)?)$/.exec(value.trim());
  return m ? Number(m[1]) * 3600 + Number(m[2]) * 60 + Number(m[3]) : NaN;
}

// An ffmpeg duration option's value in seconds: 1.5, 90, 01:30, 00:01:30.5, 1500ms, 250000us.
function durationArg(value: string): number {
  const v = value.trim();
  const unit = /^(\d+(?:\.\d+)?)(s|ms|us)$/.exec(v);
  if (unit) return Number(unit[1]) / (unit[2] === 's' ? 1 : unit[2] === 'ms' ? 1e3 : 1e6);
  if (/^\d+(?:\.\d+)?$/.test(v)) return Number(v);
  const parts = v.split(':');
  if (parts.length === 2) return seconds(`0:${v}`);
  return parts.length === 3 ? seconds(v) : NaN;
}

// How long the output will be, for the progress percentage: the input's duration, cut by -t
// (or by -to, from -ss). The last -t/-to/-ss given wins, as ffmpeg's own parsing does per file.
function expectedSeconds(inputSeconds: number, args: string[]): number {
  const last = (name: string) => {
    const i = args.lastIndexOf(name);
    return i >= 0 && i + 1 < args.length ? durationArg(args[i + 1]) : NaN;
  };
  const [t, to, ss] = [last('-t'), last('-to'), last('-ss')];
  const left = inputSeconds > 0 && ss > 0 ? Math.max(0, inputSeconds - ss) : inputSeconds;
  const cut = t >= 0 ? t : to >= 0 ? to - (ss > 0 ? ss : 0) : NaN;
  return cut >= 0 && !(left < cut) ? cut : left;
}

export async function execute(
  _toolCallId: string,
  params: Params,
  signal?: AbortSignal,
  onUpdate?: OnUpdate,
): Promise<ToolResult> {
  try {
    const program = params.program ?? 'ffmpeg';
    if (program !== 'ffmpeg' && program !== 'ffprobe') return err(`program must be ffmpeg or ffprobe, got "${program}".`);
    if (!hasCommand(program)) return err(`${program} is not installed in the sandbox (the runner image should carry it); tell the user.`);
    const timeout = params.timeout_seconds ?? 600;
    if (!(timeout >= 1 && timeout <= 3600)) return err(`timeout_seconds must be from 1 to 3600, got ${params.timeout_seconds}.`);
    const userArgs = parseArgs(params.args);
    const logPath = params.output_path ? userPath('output_path', params.output_path, false) : undefined;

    // Progress goes to fd 3, so stdout stays free for an output the user sends to "-".
    const args = program === 'ffmpeg'
      ? ['-hide_banner', '-nostdin', '-y', '-progress', 'pipe:3', '-stats_period', '1', ...userArgs]
      : ['-hide_banner', ...userArgs];
    const child = spawn(program, args, { cwd: userRoot(), stdio: ['ignore', 'pipe', 'pipe', 'pipe'] });
    const out = new Capture();
    const log = new Capture();
    let durationS = NaN;
    let progress = '';
    child.stdout!.setEncoding('utf-8').on('data', (d: string) => out.add(d));
    child.stderr!.setEncoding('utf-8').on('data', (d: string) => {
      log.add(d);
      if (Number.isNaN(durationS) && !log.dropped) {
        const m = /Duration: (\d+:\d+:\d+(?:\.\d+)?)/.exec(log.head);
        if (m) durationS = seconds(m[1]);
      }
    });
    (child.stdio[3] as NodeJS.ReadableStream).setEncoding('utf-8');
    (child.stdio[3] as NodeJS.ReadableStream).on('data', (d: string) => {
      progress += d;
      // One block of key=value lines per period, ending in progress=continue|end.
      let end: number;
      while ((end = progress.search(/progress=(continue|end)\n/)) >= 0) {
        const stop = progress.indexOf('\n', end) + 1;
        const block = Object.fromEntries(progress.slice(0, stop).split('\n').filter(Boolean).map((l) => {
          const i = l.indexOf('=');
          return [l.slice(0, i), l.slice(i + 1)];
        }));
        progress = progress.slice(stop);
        const done = seconds(block.out_time ?? '');
        const total = expectedSeconds(durationS, userArgs);
        const share = block.progress === 'end' ? 100 : Math.min(100, (100 * done) / total);
        const pct = total > 0 && done >= 0 ? ` (${share.toFixed(0)}%)` : '';
        const time = done >= 0 ? `${done.toFixed(1)} s processed` : 'starting';
        onUpdate?.({ content: [{ type: 'text', text: `ffmpeg: ${time}${pct}, speed ${block.speed ?? '?'}` }] });
      }
    });

    let timedOut = false;
    const timer = setTimeout(() => { timedOut = true; child.kill('SIGKILL'); }, timeout * 1000);
    const onAbort = () => child.kill('SIGKILL');
    signal?.addEventListener('abort', onAbort);
    const [code, sig] = await new Promise<[number | null, string | null]>((res, rej) => {
      child.on('error', rej);
      child.on('close', (c, s) => res([c, s]));
    }).finally(() => { clearTimeout(timer); signal?.removeEventListener('abort', onAbort); });

    const stdout = out.text();
    const stderr = log.text();
    if (logPath) writeFileSync(logPath, program === 'ffprobe' ? stdout + (stderr ? `\n${stderr}` : '') : stderr);
    const tail = log.last().trim().split('\n').slice(-LOG_TAIL_LINES).join('\n');
    const saved = logPath ? `\nFull log saved to ${logPath}.` : '';
    if (timedOut) return err(`${program} was stopped after ${timeout} s. Raise timeout_seconds or process a shorter piece.${saved}\n${tail}`);
    if (code !== 0) return err(`${program} exited with ${sig ? `signal ${sig}` : `status ${code}`}.${saved}\nLast lines of its log:\n${tail}`);

    if (program === 'ffprobe') {
      if (logPath) return ok(`ffprobe succeeded; ${stdout.length} characters of output saved to ${logPath}.`);
      const body = stdout.length > INLINE_STDOUT
        ? `${stdout.slice(0, INLINE_STDOUT)}\n… (${stdout.length} characters in all; pass output_path to get the whole output)`
        : stdout;
      return ok(body.trim() || tail);
    }
    const outputs = [...stderr.matchAll(/^Output #\d+, [^,]+, to '(.*)':$/gm)].map((m) => m[1]);
    const summary = outputs.length ? `Wrote ${outputs.join(', ')}.` : 'ffmpeg succeeded.';
    return ok(`${summary}${saved}\nLast lines of the log:\n${tail}`);
  } catch (e) {
    return err(e instanceof Error ? e.message : String(e));
  }
}
