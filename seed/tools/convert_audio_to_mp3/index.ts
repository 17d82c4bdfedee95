import { execFileSync, spawn } from 'node:child_process';
import { existsSync, realpathSync, statSync } from 'node:fs';
import { basename, dirname, extname, join, resolve } from 'node:path';

type ToolResult = { content: Array<{ type: string; text: string }>; isError?: boolean };
type OnUpdate = (partial: { content: Array<{ type: string; text: string }> }) => void;
type Params = { input_path: string; output_path?: string; bitrate?: string };

const TIMEOUT_MS = 30 * 60 * 1000;

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

type Audio = { duration: number; bitRate: number; sampleRate: number };

// The first audio stream's duration (s), bit rate (bit/s) and sample rate (Hz), or an error
// saying why the file is not audio.
function probeAudio(path: string): Audio {
  let out: string;
  try {
    out = execFileSync('ffprobe', ['-v', 'error', '-select_streams', 'a:0', '-show_entries',
      'stream=codec_name,bit_rate,sample_rate:format=duration,bit_rate', '-of', 'json', path],
    { encoding: 'utf-8', timeout: 60_000, stdio: ['ignore', 'pipe', 'pipe'] });
  } catch (e) {
    const why = String((e as { stderr?: string }).stderr ?? (e as Error).message).trim().split('\n').pop();
    throw new Error(`${path} is not an audio or video file ffmpeg can read (${why}). Fix: give an audio file such as WAV, M4A, OGG, FLAC or MP3.`);
  }
  const info = JSON.parse(out);
  if (!info.streams?.length) throw new Error(`${path} has no audio stream. Fix: give an audio file, or a video with sound.`);
  const stream = info.streams[0];
  return {
    duration: Number(info.format?.duration),
    bitRate: Number(stream.bit_rate ?? info.format?.bit_rate),
    sampleRate: Number(stream.sample_rate),
  };
}

// What the MP3 really is: LAME lowers a bit rate MP3 cannot carry at the input's sample
// rate (at most 160k below 32 kHz, 64k below 16 kHz), so the asked one may not be it.
function bitrateLine(asked: string, out: Audio): string {
  if (!(out.bitRate > 0)) return `Bitrate: ${asked} (asked)`;
  const kbps = Math.round(out.bitRate / 1000);
  if (`${kbps}k` === asked) return `Bitrate: ${kbps} kb/s`;
  const why = out.sampleRate > 0 && out.sampleRate < 32000 ? `, the most MP3 allows at ${out.sampleRate} Hz` : '';
  return `Bitrate: ${kbps} kb/s (${asked} was asked${why})`;
}

export async function execute(
  _toolCallId: string,
  params: Params,
  signal?: AbortSignal,
  onUpdate?: OnUpdate,
): Promise<ToolResult> {
  try {
    for (const cmd of ['ffmpeg', 'ffprobe']) {
      if (!hasCommand(cmd)) return err(`${cmd} is not installed in the sandbox (the runner image should carry it); tell the user.`);
    }
    const bitrate = params.bitrate ?? '192k';
    const kbps = /^(\d+)k$/.exec(bitrate);
    if (!kbps || Number(kbps[1]) < 32 || Number(kbps[1]) > 320) return err(`bitrate must be from 32k to 320k, e.g. "128k", got "${bitrate}".`);
    const input = userPath('input_path', params.input_path, true);
    if (!statSync(input).isFile()) return err(`input_path ${input} is not a file.`);
    const wanted = params.output_path ?? join(dirname(input), basename(input, extname(input)) + '.mp3');
    const output = userPath('output_path', wanted, false);
    if (output === input) return err(`output_path is the input file itself (${input}). Fix: give another output_path.`);
    const { duration } = probeAudio(input);

    onUpdate?.({ content: [{ type: 'text', text: `Converting ${basename(input)} (${duration.toFixed(1)} s) to MP3 at ${bitrate}…` }] });
    const child = spawn('ffmpeg', ['-hide_banner', '-nostdin', '-y', '-progress', 'pipe:3', '-stats_period', '1',
      '-i', input, '-vn', '-map', '0:a:0', '-codec:a', 'libmp3lame', '-b:a', bitrate, '-f', 'mp3', output],
    { stdio: ['ignore', 'ignore', 'pipe', 'pipe'] });
    let stderr = '';
    let progress = '';
    child.stderr!.setEncoding('utf-8').on('data', (d: string) => { stderr = (stderr + d).slice(-20_000); });
    const prog = child.stdio[3] as NodeJS.ReadableStream;
    prog.setEncoding('utf-8');
    prog.on('data', (d: string) => {
      progress += d;
      const done = [...progress.matchAll(/^out_time_us=(\d+)$/gm)].pop();
      progress = progress.slice(progress.lastIndexOf('\n') + 1);
      if (done && duration > 0) {
        const pct = Math.min(100, Number(done[1]) / 1e4 / duration);
        onUpdate?.({ content: [{ type: 'text', text: `Converting: ${pct.toFixed(0)}%` }] });
      }
    });
    const timer = setTimeout(() => child.kill('SIGKILL'), TIMEOUT_MS);
    const onAbort = () => child.kill('SIGKILL');
    signal?.addEventListener('abort', onAbort);
    const code = await new Promise<number | null>((res, rej) => {
      child.on('error', rej);
      child.on('close', (c) => res(c));
    }).finally(() => { clearTimeout(timer); signal?.removeEventListener('abort', onAbort); });
    if (code !== 0) {
      const tail = stderr.trim().split('\n').slice(-10).join('\n');
      return err(`ffmpeg could not convert ${input} (exit ${code}):\n${tail}`);
    }
    const size = statSync(output).size;
    const converted = probeAudio(output);
    return ok(`Converted to ${output}\nDuration: ${converted.duration.toFixed(2)} s\nSize: ${size} bytes (${(size / 1024 / 1024).toFixed(2)} MiB)\n${bitrateLine(bitrate, converted)}`);
  } catch (e) {
    return err(e instanceof Error ? e.message : String(e));
  }
}
