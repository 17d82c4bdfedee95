'use strict';
// Drives the shim as a child process over plain pipes (the default fds), with
// the real fixture tools in ./fixtures. Run: node --test images/node/shim/test/
const { test, describe, after } = require('node:test');
const assert = require('node:assert/strict');
const { spawn } = require('node:child_process');
const fs = require('node:fs');
const os = require('node:os');
const path = require('node:path');

const MAIN = path.join(__dirname, '..', 'src', 'main.js');
const FIX = path.join(__dirname, 'fixtures');
const entry = (name, file = 'index.ts') => path.join(FIX, name, file);

const live = new Set();
after(() => {
  for (const s of live) s.kill();
});

/** A shim child process with helpers to talk the shim protocol to it. */
class Shim {
  constructor({ env = {}, args = [], fifo = false } = {}) {
    // Node's spawn() gives the child socketpairs; `sh -c 'cat | node | cat'` gives
    // it real pipes (FIFOs), as Python's subprocess and Docker do.
    const [cmd, argv] = fifo
      ? ['sh', ['-c', '{ cat | "$0" "$1" 2>&1 1>&3 3>&- | cat >&2 3>&-; } 3>&1 | cat', process.execPath, MAIN]]
      : [process.execPath, [...args, MAIN]];
    this.proc = spawn(cmd, argv, {
      stdio: ['pipe', 'pipe', 'pipe'],
      env: { ...process.env, SANDBOXD_SHIM_FDS: '', ...env },
    });
    live.add(this);
    this.messages = []; // every protocol message, in arrival order
    this.queue = [];
    this.waiters = [];
    this.rawLines = [];
    this.bad = []; // stdout lines that are not JSON-RPC: must stay empty
    this.stderr = '';
    this.nextId = 1;
    let buf = Buffer.alloc(0);
    this.proc.stdout.on('data', (chunk) => {
      buf = Buffer.concat([buf, chunk]);
      let nl;
      while ((nl = buf.indexOf(10)) !== -1) {
        const line = buf.subarray(0, nl).toString('utf8');
        buf = buf.subarray(nl + 1);
        this.rawLines.push(line);
        let msg;
        try {
          msg = JSON.parse(line);
        } catch {
          this.bad.push(line);
          continue;
        }
        if (!msg || msg.jsonrpc !== '2.0') this.bad.push(line);
        this.messages.push(msg);
        this.queue.push(msg);
        this.pump();
      }
    });
    this.proc.stderr.on('data', (d) => {
      this.stderr += d.toString('utf8');
    });
    this.exited = new Promise((resolve) => {
      this.proc.on('exit', (code, signal) => {
        live.delete(this);
        this.exitInfo = { code, signal };
        resolve(this.exitInfo);
        this.pump();
      });
    });
  }

  pump() {
    for (const w of [...this.waiters]) {
      const i = this.queue.findIndex(w.match);
      if (i !== -1) {
        const [msg] = this.queue.splice(i, 1);
        this.waiters.splice(this.waiters.indexOf(w), 1);
        clearTimeout(w.timer);
        w.resolve(msg);
      } else if (this.exitInfo) {
        this.waiters.splice(this.waiters.indexOf(w), 1);
        clearTimeout(w.timer);
        w.reject(new Error(`shim exited (${JSON.stringify(this.exitInfo)}) while waiting; stderr:\n${this.stderr}`));
      }
    }
  }

  next(match, timeoutMs = 10000) {
    return new Promise((resolve, reject) => {
      const w = { match, resolve, reject };
      w.timer = setTimeout(() => {
        this.waiters.splice(this.waiters.indexOf(w), 1);
        reject(new Error(`timed out waiting for a message; got ${JSON.stringify(this.messages).slice(0, 2000)}\nstderr:\n${this.stderr}`));
      }, timeoutMs);
      this.waiters.push(w);
      this.pump();
    });
  }

  ready() {
    return this.next((m) => m.method === 'ready');
  }

  write(text) {
    this.proc.stdin.write(text);
  }

  send(obj) {
    this.write(`${JSON.stringify(obj)}\n`);
  }

  /** Send a request; resolve with its response (and the progress that came before it). */
  async request(method, params, id = this.nextId++) {
    const msg = { jsonrpc: '2.0', id, method };
    if (params !== undefined) msg.params = params;
    this.send(msg);
    const response = await this.next((m) => m.id === id && (m.result !== undefined || m.error !== undefined));
    const progress = this.messages.filter((m) => m.method === 'progress' && m.params.id === id);
    return { response, progress, id };
  }

  /** Run a tool call; returns { result, progress, response }. */
  async call(tool, args = {}, extra = {}) {
    const { file, ...rest } = extra;
    const e = path.isAbsolute(tool) ? tool : entry(tool, file);
    const { response, progress, id } = await this.request('call', {
      toolCallId: rest.toolCallId || `call_${this.nextId}`,
      entry: e,
      arguments: args,
      ...rest,
    });
    return { result: response.result, error: response.error, progress, response, id };
  }

  text(result) {
    return result.content.map((b) => b.text).join('\n');
  }

  async stats() {
    return (await this.request('stats')).response.result;
  }

  kill() {
    if (!this.exitInfo) this.proc.kill('SIGKILL');
  }

  async close() {
    assert.deepEqual(this.bad, [], 'only JSON-RPC lines on stdout');
    this.proc.stdin.end();
    const info = await this.exited;
    assert.equal(info.code, 0, `shim exits 0 on stdin EOF; stderr:\n${this.stderr}`);
  }
}

/** Poll until cond() holds (evidence), not for a guessed time; fail saying what did not happen. */
async function waitFor(cond, what, timeoutMs = 10000) {
  const t0 = Date.now();
  while (!cond()) {
    if (Date.now() - t0 > timeoutMs) throw new Error(`timed out after ${timeoutMs} ms waiting for ${what}`);
    await new Promise((r) => setTimeout(r, 10));
  }
}

async function withShim(fn, opts) {
  const shim = new Shim(opts);
  await shim.ready();
  try {
    await fn(shim);
  } finally {
    shim.kill();
  }
}

describe('protocol basics', () => {
  test('ready, ping, EOF exit', async () => {
    const shim = new Shim();
    const ready = await shim.ready();
    assert.deepEqual(Object.keys(ready.params).sort(), ['node', 'pid', 'protocol']);
    assert.equal(ready.params.protocol, 2);
    assert.equal(ready.params.node, process.version);
    assert.equal(ready.params.pid, shim.proc.pid);
    assert.equal(shim.messages[0], ready, 'ready comes first');
    const { response } = await shim.request('ping');
    assert.deepEqual(response, { jsonrpc: '2.0', id: 1, result: {} });
    const str = await shim.request('ping', undefined, 'abc');
    assert.deepEqual(str.response.result, {});
    await shim.close();
  });

  test('shutdown exits 0 promptly', async () => {
    const shim = new Shim();
    await shim.ready();
    const t0 = Date.now();
    shim.send({ jsonrpc: '2.0', method: 'shutdown' });
    const info = await shim.exited;
    assert.equal(info.code, 0);
    assert.ok(Date.now() - t0 < 2000);
  });

  test('malformed input, unknown methods, blank lines and CRLF', async () => {
    await withShim(async (shim) => {
      shim.write('this is not json\n');
      const parse = await shim.next((m) => m.error && m.error.code === -32700);
      assert.equal(parse.id, null);
      shim.write('\n\r\n   \n');
      shim.write('[1,2]\n');
      const invalid = await shim.next((m) => m.error && m.error.code === -32600);
      assert.equal(invalid.id, null);
      shim.write('{"jsonrpc":"2.0","id":7,"method":"nope"}\r\n');
      const unknown = await shim.next((m) => m.id === 7);
      assert.equal(unknown.error.code, -32601);
      assert.match(unknown.error.message, /nope/);
      shim.write('{"jsonrpc":"2.0","method":"also-nope"}\n'); // notification: no answer
      shim.write('{"jsonrpc":"2.0","id":8,"method":"ping"}\r\n');
      const pong = await shim.next((m) => m.id === 8);
      assert.deepEqual(pong.result, {});
      // split across writes, two messages in one write
      shim.write('{"jsonrpc":"2.0","id":9,');
      await new Promise((r) => setTimeout(r, 20));
      shim.write('"method":"ping"}\n{"jsonrpc":"2.0","id":10,"method":"ping"}\n');
      await shim.next((m) => m.id === 9);
      await shim.next((m) => m.id === 10);
      const errors = shim.messages.filter((m) => m.error);
      assert.equal(errors.length, 3, JSON.stringify(errors));
      await shim.close();
    });
  });

  test('bad call params are -32602', async () => {
    await withShim(async (shim) => {
      const { response } = await shim.request('call', { entry: 42 });
      assert.equal(response.error.code, -32602);
      const r2 = await shim.request('call', { entry: entry('hello'), arguments: [1] });
      assert.equal(r2.response.error.code, -32602);
      const r3 = await shim.request('call', { entry: entry('hello'), env: { 'A=B': 'x' } });
      assert.equal(r3.response.error.code, -32602);
    });
  });

  test('U+2028/U+2029 inside strings are not line breaks', async () => {
    await withShim(async (shim) => {
      const text = 'before\u2028middle\u2029after "quoted" \\ back\ttab é 😀';
      const line = JSON.stringify({
        jsonrpc: '2.0',
        id: 1,
        method: 'call',
        params: { toolCallId: 'u1', entry: entry('echo'), arguments: { text } },
      });
      assert.ok(line.includes('\u2028'), 'JSON.stringify keeps U+2028 raw');
      shim.write(`${line}\n`);
      const res = await shim.next((m) => m.id === 1);
      assert.equal(res.result.status, 'ok');
      assert.equal(res.result.content[0].text, text);
      assert.ok(shim.rawLines.some((l) => l.includes('\u2028')), 'the response carries it raw too');
      await shim.close();
    });
  });
});

describe('warm-up before ready', () => {
  // The shim's own tool, which main.js calls once before `ready` (the same path as loader.js resolves it).
  const WARMUP_ENTRY = path.join(fs.realpathSync(path.join(__dirname, '..', 'src', 'warm-up')), 'index.ts');

  test('its call leaves no trace: nothing on the protocol or stderr, counters at zero, tools load as before', async () => {
    await withShim(async (shim) => {
      let s = await shim.stats();
      assert.deepEqual(
        [s.calls, s.loads, s.transpiles, s.transpileCacheHits, s.precompiledHits, s.reloads, s.leftoverChecks],
        [0, 0, 0, 0, 0, 0, 0],
      );
      assert.equal(shim.messages[0].method, 'ready', 'nothing of the warm-up reaches the protocol');
      const { result } = await shim.call('hello', { name: 'Ada' });
      assert.equal(result.status, 'ok', JSON.stringify(result));
      s = await shim.stats();
      assert.deepEqual([s.calls, s.loads, s.transpiles], [1, 1, 1]);
      assert.doesNotMatch(shim.stderr, /warm-up/, 'the warm-up neither failed nor logged');
      await shim.close();
    });
  });

  test('its loopback socket delivers the line whole, then leaves no listener or socket open', async () => {
    const io = require('../src/io');
    const pipes = () => process.getActiveResourcesInfo().filter((r) => /Pipe/.test(r)).length;
    const before = pipes();
    const text = `${JSON.stringify({ line: 'x'.repeat(3000) })}\n`;
    const chunks = [];
    await io.loopback(text, (chunk) => chunks.push(chunk));
    assert.equal(Buffer.concat(chunks).toString('utf8'), text);
    await waitFor(() => pipes() === before, 'the loopback sockets to close');
  });

  test('code planted in the transpile cache under the warm-up tool\'s key is never run', async () => {
    const cache = fs.mkdtempSync(path.join(os.tmpdir(), 'shim-warmup-cache-'));
    const marker = path.join(cache, 'planted-ran');
    try {
      const esbuildVersion = require('esbuild/package.json').version;
      const source = fs.readFileSync(WARMUP_ENTRY, 'utf8');
      const key = require('node:crypto')
        .createHash('sha256')
        .update(`sandboxd-transpile-1\0${esbuildVersion}\0ts\0${WARMUP_ENTRY}\0`)
        .update(source)
        .digest('hex');
      fs.writeFileSync(
        path.join(cache, `${key}.js`),
        `require('node:fs').writeFileSync(${JSON.stringify(marker)}, 'ran');\n` +
          "exports.execute = async () => ({ content: [{ type: 'text', text: 'planted' }] });\n",
      );
      await withShim(async (shim) => {
        assert.equal((await shim.stats()).precompiledHits, 0);
        assert.equal(fs.existsSync(marker), false, 'the warm-up ran the planted code');
        const { result } = await shim.call('hello', { name: 'Ada' });
        assert.equal(shim.text(result), 'Hello, Ada!');
        await shim.close();
      }, { env: { SANDBOXD_TRANSPILE_CACHE: cache } });
      assert.equal(fs.existsSync(marker), false, 'the planted code ran');
    } finally {
      fs.rmSync(cache, { recursive: true, force: true });
    }
  });
});

describe('loading tools', () => {
  test('TypeScript ESM (the TOOLS.md hello)', async () => {
    await withShim(async (shim) => {
      const { result, progress } = await shim.call('hello', { name: 'World' });
      assert.deepEqual(result, { status: 'ok', content: [{ type: 'text', text: 'Hello, World!' }], isError: false });
      assert.equal(progress.length, 0);
      await shim.close();
    });
  });

  test('JavaScript ESM without package.json', async () => {
    await withShim(async (shim) => {
      const { result } = await shim.call('hello-js', { name: 'Ada' }, { file: 'index.js', toolCallId: 'js_1' });
      assert.equal(result.status, 'ok');
      assert.equal(shim.text(result), 'js-esm Ada from index.js (js_1)');
    });
  });

  test('JavaScript CommonJS (module.exports = { execute }) with details', async () => {
    await withShim(async (shim) => {
      const { result } = await shim.call('cjs-js', { name: 'Bob' }, { file: 'index.js', toolCallId: 'cjs_1' });
      assert.equal(result.status, 'ok');
      assert.equal(shim.text(result), 'js-cjs Bob from index.js in cjs-js');
      assert.deepEqual(result.details, { toolCallId: 'cjs_1' });
    });
  });

  test('TypeScript in CommonJS style with a sibling require', async () => {
    await withShim(async (shim) => {
      const { result } = await shim.call('cjs-ts', { name: 'eve' });
      assert.equal(shim.text(result), 'ts-cjs EVE in cjs-ts');
    });
  });

  test('relative imports, JSON, .cjs, import type, dynamic import, per-file __dirname/import.meta.url', async () => {
    await withShim(async (shim) => {
      const { result } = await shim.call('relative', { a: 2, b: 3 });
      assert.equal(result.status, 'ok', JSON.stringify(result));
      const kv = Object.fromEntries(shim.text(result).split('\n').map((l) => [l.slice(0, l.indexOf('=')), l.slice(l.indexOf('=') + 1)]));
      const dir = path.join(FIX, 'relative');
      assert.equal(kv.sum, '5');
      assert.equal(kv.shout, 'HI!');
      assert.equal(kv.data, '42');
      assert.equal(kv.legacy, '42');
      assert.equal(kv.lazy, 'loaded lazily');
      assert.equal(kv.sides, '3');
      assert.equal(kv.join, path.join('x', 'y'));
      assert.equal(kv.mathDir, path.join(dir, 'lib'));
      assert.equal(kv.mathFile, path.join(dir, 'lib', 'math.ts'));
      assert.equal(kv.mathUrl, `file://${path.join(dir, 'lib', 'math.ts')}`);
      assert.equal(kv.helperUrl, `file://${path.join(dir, 'lib', 'helper.js')}`);
      assert.equal(kv.indexUrl, `file://${path.join(dir, 'index.ts')}`);
      assert.equal(kv.indexFile, path.join(dir, 'index.ts'));
    });
  });

  test('bin/ helpers found through __dirname and import.meta.url', async () => {
    await withShim(async (shim) => {
      const { result } = await shim.call('bin-helper', { name: 'Zed' });
      assert.equal(result.status, 'ok', JSON.stringify(result));
      assert.equal(shim.text(result), 'python greets Zed\nsh greets Zed\nsame=true');
    });
  });

  test('full TypeScript syntax: enums, const enums, namespaces, decorators, parameter properties', async () => {
    await withShim(async (shim) => {
      const { result } = await shim.call('ts-features', { w: 3, h: 4 });
      assert.equal(result.status, 'ok', JSON.stringify(result));
      assert.equal(shim.text(result), 'describe:area=12 cm 0,green,10,2 3');
    });
  });

  test('top-level await gets a clear error', async () => {
    await withShim(async (shim) => {
      const { result } = await shim.call('tla');
      assert.equal(result.status, 'error');
      assert.match(shim.text(result), /index\.ts:1:\d+: .*[Tt]op-level await.*move the await into execute\(\)/);
    });
  });

  test('an error while the module loads says so', async () => {
    await withShim(async (shim) => {
      const { result } = await shim.call('load-throw');
      assert.equal(result.status, 'error');
      assert.match(shim.text(result), /^ENOENT: no such file or directory, open '\/nonexistent\/sandboxd-config\.json' \(while loading .*load-throw\/index\.ts\)$/);
    });
  });

  test('entry not found is an error result; the shim keeps going', async () => {
    await withShim(async (shim) => {
      const { result } = await shim.call('hello', {}, { file: 'missing.ts' });
      assert.equal(result.status, 'error');
      assert.match(shim.text(result), /entry file not found/);
      const again = await shim.call('hello', { name: 'x' });
      assert.equal(again.result.status, 'ok');
    });
  });

  test('an unchanged tool is transpiled once per process', async () => {
    await withShim(async (shim) => {
      for (let i = 0; i < 3; i++) {
        const { result } = await shim.call('hello', { name: String(i) });
        assert.equal(shim.text(result), `Hello, ${i}!`);
      }
      let s = await shim.stats();
      assert.equal(s.transpiles, 1);
      assert.equal(s.loads, 1);
      await shim.call('relative', { a: 1, b: 1 });
      await shim.call('relative', { a: 1, b: 1 });
      s = await shim.stats();
      // index.ts, lib/math.ts, lib/helper.js, lib/legacy.cjs, lib/lazy.ts (+1 for hello)
      assert.equal(s.transpiles, 6);
      assert.equal(s.loads, 2);
      assert.equal(s.reloads, 0);
    });
  });

  test('an edited entry (or sibling) is reloaded at the next call; unchanged files are not re-transpiled', async () => {
    const tmp = fs.mkdtempSync(path.join(os.tmpdir(), 'shim-reload-'));
    try {
      const dir = path.join(tmp, 'tool');
      fs.mkdirSync(dir);
      fs.writeFileSync(path.join(dir, 'TOOL.md'), '---\nname: tool\ndescription: reload test\nversion: 1\n---\n');
      fs.writeFileSync(path.join(dir, 'greeting.ts'), "export const greeting: string = 'Hello';\n");
      const write = (v) =>
        fs.writeFileSync(
          path.join(dir, 'index.ts'),
          `import { greeting } from './greeting';\nexport async function execute(_id: string, p: { name: string }) {\n  return { content: [{ type: 'text', text: \`\${greeting}, \${p.name} (v${v})\` }] };\n}\n`,
        );
      write(1);
      await withShim(async (shim) => {
        const e = path.join(dir, 'index.ts');
        assert.equal(shim.text((await shim.call(e, { name: 'A' })).result), 'Hello, A (v1)');
        assert.equal(shim.text((await shim.call(e, { name: 'B' })).result), 'Hello, B (v1)');
        write(2);
        assert.equal(shim.text((await shim.call(e, { name: 'C' })).result), 'Hello, C (v2)');
        let s = await shim.stats();
        assert.equal(s.reloads, 1);
        assert.equal(s.transpiles, 3, 'index v1, greeting, index v2 (greeting came from the cache)');
        fs.writeFileSync(path.join(dir, 'greeting.ts'), "export const greeting: string = 'Hi';\n");
        assert.equal(shim.text((await shim.call(e, { name: 'D' })).result), 'Hi, D (v2)');
        s = await shim.stats();
        assert.equal(s.reloads, 2);
        assert.equal(s.transpiles, 4);
        // A broken edit fails the call; fixing it works again without a restart.
        fs.writeFileSync(e, 'export async function execute( {\n');
        const broken = await shim.call(e, { name: 'E' });
        assert.equal(broken.result.status, 'error');
        assert.match(shim.text(broken.result), /index\.ts:\d+:\d+/);
        write(3);
        assert.equal(shim.text((await shim.call(e, { name: 'F' })).result), 'Hi, F (v3)');
        // Replaced wholesale (rm + cp, as sync-tools does).
        fs.rmSync(dir, { recursive: true });
        fs.mkdirSync(dir);
        fs.writeFileSync(path.join(dir, 'greeting.ts'), "export const greeting: string = 'Hey';\n");
        write(4);
        assert.equal(shim.text((await shim.call(e, { name: 'G' })).result), 'Hey, G (v4)');
      });
    } finally {
      fs.rmSync(tmp, { recursive: true, force: true });
    }
  });
});

describe('calling', () => {
  test('progress messages arrive in order, before the result, coerced to content arrays', async () => {
    await withShim(async (shim) => {
      const { result, progress, id } = await shim.call('progress', { steps: 4 });
      assert.equal(result.status, 'ok');
      const contents = progress.map((p) => p.params.content);
      assert.deepEqual(contents, [
        [{ type: 'text', text: 'step 1' }],
        [{ type: 'text', text: 'step 2' }],
        [{ type: 'text', text: 'step 3' }],
        [{ type: 'text', text: 'step 4' }],
        [{ type: 'text', text: 'a bare string' }],
        [{ type: 'text', text: "{ phase: 'odd shape' }" }],
        [
          { type: 'text', text: 'an array' },
          { type: 'text', text: 'and a string' },
        ],
      ]);
      const order = shim.messages.filter((m) => m.id === id || (m.params && m.params.id === id));
      assert.equal(order[order.length - 1].result, result, 'the result is last');
    });
  });

  test('cancel aborts the AbortSignal at once with the reason; unknown ids are ignored', async () => {
    await withShim(async (shim) => {
      shim.send({ jsonrpc: '2.0', id: 'c-1', method: 'call', params: { toolCallId: 'abort_1', entry: entry('abort'), arguments: {} } });
      await shim.next((m) => m.method === 'progress' && m.params.id === 'c-1');
      shim.send({ jsonrpc: '2.0', method: 'cancel', params: { id: 'nope', reason: 'wrong id' } });
      shim.send({ jsonrpc: '2.0', method: 'cancel', params: { id: 'c-1', reason: 'user pressed stop' } });
      const res = await shim.next((m) => m.id === 'c-1', 2000);
      assert.equal(shim.text(res.result), 'aborted=true name=AbortError message=user pressed stop');
      assert.equal(res.result.status, 'error');
      assert.match(shim.stderr, /\[abort_1\] cancel: user pressed stop/);
      // cancel of a finished call: nothing happens
      shim.send({ jsonrpc: '2.0', method: 'cancel', params: { id: 'c-1' } });
      const { response } = await shim.request('ping');
      assert.deepEqual(response.result, {});
      assert.equal(shim.messages.filter((m) => m.error).length, 0);
      await shim.close();
    });
  });

  test('a thrown error becomes an error result; stack on stderr points at the TS line', async () => {
    await withShim(async (shim) => {
      const src = fs.readFileSync(entry('throw'), 'utf8').split('\n');
      const line = src.findIndex((l) => l.includes('THROW_LINE')) + 1;
      const { result } = await shim.call('throw', {}, { toolCallId: 'throw_1' });
      assert.deepEqual(result, { status: 'error', content: [{ type: 'text', text: 'boom: the thing failed' }], isError: true });
      assert.match(shim.stderr, /\[throw_1\] execute failed: Error: boom: the thing failed/);
      assert.ok(shim.stderr.includes(`${entry('throw')}:${line}:`), `stack maps to index.ts:${line}\n${shim.stderr}`);
      // The tool's frames only: the shim's own ten (dispatch, line reader, socket) are dropped.
      const logged = shim.stderr.slice(shim.stderr.indexOf('[throw_1] execute failed:')).split('\n')
        .filter((l) => l.startsWith('[throw_1]'));
      assert.equal(logged.length, 2, `the message and the tool's one frame:\n${logged.join('\n')}`);
      assert.ok(!logged.some((l) => l.includes(path.join('shim', 'src')) || l.includes('(node:')), logged.join('\n'));
      const type = await shim.call('throw', { kind: 'type' });
      assert.match(shim.text(type.result), /^TypeError: Cannot read properties of undefined/);
      const str = await shim.call('throw', { kind: 'string' });
      assert.equal(shim.text(str.result), 'a thrown string');
    });
  });

  test('results that are not ToolResults become error results that say what was returned', async () => {
    await withShim(async (shim) => {
      const cases = {
        undefined: /^execute returned undefined; return \{ content: \[\{ type: "text", text: "\.\.\." \}\] \}$/,
        console: /^execute returned undefined \(it printed to stdout, which the agent never sees\); return \{ content/,
        null: /^execute returned null; return/,
        string: /^execute returned a string \("just a string"\), not a ToolResult; return/,
        number: /^execute returned a number \(42\)/,
        array: /^execute returned an array of 1 item\(s\) instead of an object with a content array/,
        'no-content': /^execute returned an object without a content array \(keys: text, ok\)/,
        'content-string': /content must be an array/,
        'bad-block': /^content\[1\] is .*wrong key.*not a text block/,
        bigint: /cannot be sent as JSON \(Do not know how to serialize a BigInt\)/,
        circular: /cannot be sent as JSON \(Converting circular structure to JSON\)/,
      };
      for (const [kind, re] of Object.entries(cases)) {
        const { result } = await shim.call('bad-results', { kind });
        assert.equal(result.status, 'error', kind);
        assert.equal(result.isError, true, kind);
        assert.equal(result.content.length, 1, kind);
        assert.match(shim.text(result), re, kind);
      }
      const isErr = (await shim.call('bad-results', { kind: 'is-error' })).result;
      assert.deepEqual(isErr, { status: 'error', content: [{ type: 'text', text: 'API key not found.' }], isError: true });
      const details = (await shim.call('bad-results', { kind: 'details' })).result;
      assert.deepEqual(details, { status: 'ok', content: [{ type: 'text', text: 'with details' }], isError: false, details: { rows: 3, list: [1, 2] } });
      const image = (await shim.call('bad-results', { kind: 'image' })).result;
      assert.equal(image.status, 'ok');
      assert.deepEqual(image.content[0], { type: 'image', data: 'iVBORw0KGgo=', mimeType: 'image/png' });
    });
  });

  test('Common Mistakes get actionable messages', async () => {
    await withShim(async (shim) => {
      const bun = (await shim.call('bun')).result;
      assert.equal(bun.status, 'error');
      assert.equal(shim.text(bun), 'Bun is not defined: tools run on Node.js; use fs/child_process/setTimeout instead of Bun APIs');
      const cls = shim.text((await shim.call('class-export')).result);
      assert.match(cls, /index\.ts does not export execute; it exports: MyTool \(class\)\. Class-based tools are not supported; export a named function instead: export async function execute\(/);
      const fn = shim.text((await shim.call('module-exports-fn', {}, { file: 'index.js' })).result);
      assert.match(fn, /index\.js sets module\.exports to a function \(main\), so there is no execute export; export a named function instead: export async function execute\(/);
      const klass = shim.text((await shim.call('module-exports-class', {}, { file: 'index.js' })).result);
      assert.match(klass, /sets module\.exports to a class \(SearchTool\)/);
      const none = shim.text((await shim.call('no-execute')).result);
      assert.match(none, /does not export execute; it exports: /);
      for (const part of ['name (string)', 'run (function)', 'default (function)']) assert.ok(none.includes(part), none);
      const cli = shim.text((await shim.call('cli')).result);
      assert.match(cli, /does not export anything \(a CLI entry point, or output printed with console\.log, is never seen by the agent\)/);
      assert.ok(!shim.stderr.includes('\nresult\n'), 'the CLI main() did not run');
    });
  });

  test('console noise and child process output never reach the protocol stream', async () => {
    await withShim(async (shim) => {
      const { result } = await shim.call('console-noise', {}, { toolCallId: 'noise_1' });
      assert.equal(result.status, 'ok', JSON.stringify(result));
      assert.equal(shim.text(result), 'quiet result; child stdin read 0 bytes');
      const lines = [
        '[noise_1] noise at load time',
        '[noise_1] console.log line',
        '[noise_1] console.info line',
        '[noise_1] console.error line',
        "[noise_1] { an: 'object' }",
        '[noise_1] partial stdout.write line',
        '[noise_1] second line',
        '[noise_1] stderr buffer line',
        'child echo line',
        'spawnSync child line',
        'spawnSync child err',
        '[noise_1 (finished)] late line after the result',
      ];
      // Child output and the late line come on their own time: wait for them, not for 100 ms.
      await waitFor(() => lines.every((line) => shim.stderr.includes(line)), 'every line on stderr').catch(() => {});
      await shim.request('ping');
      for (const line of lines) {
        assert.ok(shim.stderr.includes(line), `stderr has ${JSON.stringify(line)}:\n${shim.stderr}`);
      }
      await shim.close();
    });
  });

  test('per-call env is set for the call and restored afterwards', async () => {
    await withShim(
      async (shim) => {
        const names = ['SHIM_TEST_PRESET', 'SHIM_TEST_NEW', 'SHIM_TEST_EMPTY'];
        const first = await shim.call('env', { names }, { env: { SHIM_TEST_PRESET: 'override', SHIM_TEST_NEW: 'new', SHIM_TEST_EMPTY: '' } });
        assert.deepEqual(JSON.parse(shim.text(first.result)), { SHIM_TEST_PRESET: 'override', SHIM_TEST_NEW: 'new', SHIM_TEST_EMPTY: '' });
        const second = await shim.call('env', { names });
        assert.deepEqual(JSON.parse(shim.text(second.result)), { SHIM_TEST_PRESET: 'original', SHIM_TEST_NEW: null, SHIM_TEST_EMPTY: null });
        // restored even when the call fails
        await shim.call('throw', {}, { env: { SHIM_TEST_PRESET: 'during-throw' } });
        const third = await shim.call('env', { names: ['SHIM_TEST_PRESET'] });
        assert.deepEqual(JSON.parse(shim.text(third.result)), { SHIM_TEST_PRESET: 'original' });
      },
      { env: { SHIM_TEST_PRESET: 'original' } },
    );
  });

  test('one call at a time: a concurrent call is busy (-32000); ping still answers', async () => {
    await withShim(async (shim) => {
      // `abort` says it runs, then waits for a cancel: the first call runs for as long as the test needs.
      shim.send({ jsonrpc: '2.0', id: 1, method: 'call', params: { toolCallId: 'abort_1', entry: entry('abort'), arguments: {} } });
      await shim.next((m) => m.method === 'progress' && m.params.id === 1);
      const busy = await shim.request('call', { toolCallId: 'x', entry: entry('hello'), arguments: { name: 'x' } }, 2);
      assert.equal(busy.response.error.code, -32000);
      assert.match(busy.response.error.message, /^busy: /);
      await shim.request('ping', undefined, 3);
      assert.equal(shim.messages.filter((m) => m.id === 1).length, 0, 'ping is answered while the call runs');
      shim.send({ jsonrpc: '2.0', method: 'cancel', params: { id: 1, reason: 'done' } });
      const first = await shim.next((m) => m.id === 1);
      assert.match(shim.text(first.result), /^aborted=true/);
      assert.equal((await shim.call('hello', { name: 'after' })).result.status, 'ok');
    });
  });

  test('results over maxResultBytes are cut to fit, with a note', async () => {
    await withShim(async (shim) => {
      const max = 10000;
      const { response, result } = await shim.call('bad-results', { kind: 'big', size: 50000 }, { maxResultBytes: max });
      assert.ok(Buffer.byteLength(JSON.stringify(response.result)) <= max, 'fits');
      assert.ok(Buffer.byteLength(JSON.stringify(response.result)) > max - 200, 'and uses the room');
      assert.equal(result.status, 'ok');
      assert.equal(result.content.length, 2);
      assert.equal(result.content[1].text, `[result cut at ${max} bytes by sandboxd: write large output to a file (output_path) and return a summary]`);
      assert.ok(result.content[0].text.startsWith('é"\\\n\u2028abc'));
      // under the limit: untouched
      const small = await shim.call('bad-results', { kind: 'big', size: 1000 }, { maxResultBytes: max });
      assert.equal(small.result.content.length, 2);
      assert.equal(small.result.content[0].text.length, 1000);
    });
  });

  test('a ~1 MB result line is written whole and in order after its progress', async () => {
    await withShim(async (shim) => {
      const size = 1000 * 1000;
      const { result, response } = await shim.call('bad-results', { kind: 'big', size }, { maxResultBytes: 4 * 1024 * 1024 });
      assert.equal(result.content[0].text.length, size);
      const raw = shim.rawLines.find((l) => l.startsWith(`{"jsonrpc":"2.0","id":${response.id}`));
      assert.ok(Buffer.byteLength(raw) > size);
      const p = await shim.call('progress', { steps: 2 });
      assert.equal(p.progress.length, 5);
    });
  });

  test('stray async errors: after the result they are logged; during a call they fail it; the shim lives on', async () => {
    await withShim(async (shim) => {
      const a = await shim.call('stray', { kind: 'reject-after' }, { toolCallId: 'stray_1' });
      assert.equal(a.result.status, 'ok');
      const rejected = /\[stray_1 \(finished\)\] unhandled rejection: Error: late rejection after the result/;
      await waitFor(() => rejected.test(shim.stderr), 'the late rejection to be logged');
      const b = await shim.call('stray', { kind: 'throw-after' }, { toolCallId: 'stray_2' });
      assert.equal(b.result.status, 'ok');
      const thrown = /\[stray_2 \(finished\)\] uncaught exception: Error: late timer exception after the result/;
      await waitFor(() => thrown.test(shim.stderr), 'the late exception to be logged');
      assert.deepEqual((await shim.request('ping')).response.result, {}); // the shim lives on
      const c = await shim.call('stray', { kind: 'timer-throw' }, { toolCallId: 'stray_3' });
      assert.equal(c.result.status, 'error');
      assert.match(shim.text(c.result), /^TypeError: callback blew up inside a timer \(an uncaught exception in the tool's asynchronous code;/);
      const d = await shim.call('stray', { kind: 'reject-during' }, { toolCallId: 'stray_4' });
      assert.equal(d.result.status, 'error');
      assert.match(shim.text(d.result), /^nobody awaited this \(an unhandled rejection/);
      await waitFor(() => shim.stderr.includes('[stray_4 (finished)] execute settled after its call was answered'),
        'the failed call\'s execute to settle late');
      assert.equal((await shim.call('hello', { name: 'still here' })).result.status, 'ok');
      assert.equal(shim.messages.filter((m) => m.id === d.id).length, 1, 'the late settle sent nothing');
      await shim.close();
    });
  });

  test("a finished call's stray error does not fail the next call", async () => {
    await withShim(async (shim) => {
      const trigger = path.join(fs.mkdtempSync(path.join(os.tmpdir(), 'stray-')), 'now');
      const a = await shim.call('stray', { kind: 'reject-on-trigger', trigger }, { toolCallId: 'early' });
      assert.equal(a.result.status, 'ok');
      // `late` runs (it said so) when the test lets early's rejection land: no race with a timer.
      shim.send({ jsonrpc: '2.0', id: 'late', method: 'call', params: { toolCallId: 'late', entry: entry('abort'), arguments: {} } });
      await shim.next((m) => m.method === 'progress' && m.params.id === 'late');
      fs.writeFileSync(trigger, '');
      await waitFor(() => /\[late\] unhandled rejection from early \(finished\): Error: late rejection after the result/.test(shim.stderr),
        "early's rejection to land while late runs");
      shim.send({ jsonrpc: '2.0', method: 'cancel', params: { id: 'late', reason: 'done' } });
      const b = await shim.next((m) => m.id === 'late');
      // Not failed by early's rejection: it ends as the abort fixture ends, by its own words.
      assert.match(shim.text(b.result), /^aborted=true name=\S+ message=done/, JSON.stringify(b.result));
      await shim.close();
    });
  });

  test('process.exit in a tool ends the shim', async () => {
    const shim = new Shim();
    await shim.ready();
    shim.send({ jsonrpc: '2.0', id: 1, method: 'call', params: { toolCallId: 'exit_1', entry: entry('exit'), arguments: { code: 7 } } });
    const info = await shim.exited;
    assert.equal(info.code, 7);
    assert.equal(shim.messages.filter((m) => m.id === 1).length, 0);
  });
});

describe('fds', () => {
  for (const fifo of [false, true]) {
    test(`default fds over ${fifo ? 'pipes (moved off fds 0/1)' : 'socketpairs (child_process patched)'}: children cannot touch the protocol`, async () => {
      const shim = new Shim({ fifo });
      await shim.ready();
      const { result } = await shim.call('console-noise', { rawFd1: fifo }, { toolCallId: 'kid_1' });
      assert.equal(shim.text(result), 'quiet result; child stdin read 0 bytes');
      await shim.request('ping');
      for (const line of ['child echo line', 'spawnSync child line', '[kid_1] console.log line', ...(fifo ? ['fs.writeSync(1) line'] : [])]) {
        assert.ok(shim.stderr.includes(line), `stderr has ${line}:\n${shim.stderr}`);
      }
      if (!fifo) assert.match(shim.stderr, /protocol stays on fds 0\/1 \(stdin\/stdout are not pipes\)/);
      else assert.ok(!shim.stderr.includes('protocol stays on fds 0/1'), shim.stderr);
      await shim.close();
    });
  }

  test('SANDBOXD_SHIM_FDS=3,4 uses extra fds and leaves 0/1 to tools', async () => {
    const proc = spawn(process.execPath, [MAIN], {
      stdio: ['ignore', 'pipe', 'pipe', 'pipe', 'pipe'],
      env: { ...process.env, SANDBOXD_SHIM_FDS: '3,4' },
    });
    let out3 = '';
    let out1 = '';
    let err = '';
    proc.stdio[3].on('data', (d) => (out3 += d));
    proc.stdout.on('data', (d) => (out1 += d));
    proc.stderr.on('data', (d) => (err += d));
    const wait = (re) =>
      new Promise((resolve, reject) => {
        const t0 = Date.now();
        const iv = setInterval(() => {
          if (re.test(out3)) {
            clearInterval(iv);
            resolve();
          } else if (Date.now() - t0 > 10000) {
            clearInterval(iv);
            reject(new Error(`timeout: ${out3} ${err}`));
          }
        }, 10);
      });
    await wait(/"ready"/);
    proc.stdio[4].write(`${JSON.stringify({ jsonrpc: '2.0', id: 1, method: 'call', params: { toolCallId: 'fd_1', entry: entry('console-noise'), arguments: {} } })}\n`);
    await wait(/"id":1/);
    proc.stdio[4].end();
    const code = await new Promise((r) => proc.on('exit', r));
    assert.equal(code, 0);
    for (const line of out3.trim().split('\n')) assert.equal(JSON.parse(line).jsonrpc, '2.0');
    assert.match(out3, /quiet result/);
    assert.match(out1 + err, /child echo line/);
    assert.match(err, /\[fd_1\] console\.log line/);
  });

  test('a shim whose stderr reader went away exits instead of spinning on EPIPE', async () => {
    const proc = spawn(process.execPath, [MAIN], {
      stdio: ['ignore', 'ignore', 'pipe', 'pipe', 'pipe'],
      env: { ...process.env, SANDBOXD_SHIM_FDS: '3,4', SANDBOXD_SHIM_PREWARM: '0' },
    });
    let out3 = '';
    proc.stdio[3].on('data', (d) => (out3 += d));
    await waitFor(() => out3.includes('"ready"'), 'ready');
    proc.stderr.destroy(); // the daemon that read the shim's stderr is gone
    const exited = new Promise((r) => proc.on('exit', (code) => r(code)));
    proc.stdio[4].write(`${JSON.stringify({ jsonrpc: '2.0', id: 1, method: 'call', params: { toolCallId: 'epipe_1', entry: entry('console-noise'), arguments: {} } })}\n`);
    const timer = setTimeout(() => proc.kill('SIGKILL'), 10000);
    const code = await exited;
    clearTimeout(timer);
    assert.equal(code, 0, 'killed after 10 s: the shim kept running with nobody reading its stderr');
  });

  test('SANDBOXD_SHIM_SOCKET: the protocol runs over the daemon\'s socket, fds 3/4 are closed', async () => {
    const net = require('node:net');
    const dir = fs.mkdtempSync(path.join(os.tmpdir(), 'shim-sock-'));
    const sockPath = path.join(dir, 'shim.sock');
    const server = net.createServer({ allowHalfOpen: true });
    const accepted = new Promise((resolve) => server.once('connection', resolve));
    await new Promise((resolve) => server.listen(sockPath, resolve));
    const proc = spawn(process.execPath, [MAIN], {
      stdio: ['ignore', 'pipe', 'pipe', 'pipe', 'pipe'],
      env: { ...process.env, SANDBOXD_SHIM_FDS: '3,4', SANDBOXD_SHIM_SOCKET: sockPath },
    });
    let out3 = '';
    let err = '';
    proc.stdio[3].on('data', (d) => (out3 += d));
    const stdoutClosed = new Promise((resolve) => proc.stdio[3].on('end', resolve));
    proc.stderr.on('data', (d) => (err += d));
    const exited = new Promise((r) => proc.on('exit', r));
    after(() => proc.kill());
    const conn = await accepted;
    server.close();
    let got = '';
    const lines = [];
    conn.on('data', (d) => {
      got += d;
      let nl;
      while ((nl = got.indexOf('\n')) !== -1) {
        lines.push(JSON.parse(got.slice(0, nl)));
        got = got.slice(nl + 1);
      }
    });
    const wait = async (pred) => {
      for (let i = 0; i < 1000 && !lines.some(pred); i += 1) await new Promise((r) => setTimeout(r, 10));
      const found = lines.find(pred);
      assert.ok(found, `no such message; got ${JSON.stringify(lines)}; stderr ${err}`);
      return found;
    };
    const ready = await wait((m) => m.method === 'ready');
    assert.equal(ready.params.protocol, 2);
    conn.write(`${JSON.stringify({ jsonrpc: '2.0', id: 1, method: 'call', params: { toolCallId: 's_1', entry: entry('hello'), arguments: { name: 'socket' } } })}\n`);
    const res = await wait((m) => m.id === 1);
    assert.equal(res.result.content[0].text, 'Hello, socket!');
    // The wrapper's protocol fds were closed: the shim can no longer write to the container's stdout.
    await stdoutClosed;
    conn.end(); // the daemon going away ends the shim
    const code = await exited;
    assert.equal(code, 0, err);
    assert.equal(out3, '', 'nothing may reach the old protocol fd');
    fs.rmSync(dir, { recursive: true, force: true });
  });

  test('SANDBOXD_SHIM_SOCKET that cannot be reached: exit 1 with the reason on stderr', async () => {
    const proc = spawn(process.execPath, [MAIN], {
      stdio: ['ignore', 'pipe', 'pipe'],
      env: { ...process.env, SANDBOXD_SHIM_FDS: '', SANDBOXD_SHIM_SOCKET: '/nonexistent/shim.sock' },
    });
    let err = '';
    proc.stderr.on('data', (d) => (err += d));
    const code = await new Promise((r) => proc.on('exit', r));
    assert.equal(code, 1);
    assert.match(err, /cannot connect to the daemon's socket \/nonexistent\/shim\.sock/);
  });
});
