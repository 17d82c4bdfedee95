'use strict';
// Unit tests of result handling (src/result.js) and the line splitter (src/io.js).
const { test } = require('node:test');
const assert = require('node:assert/strict');
const results = require('../src/result');
const { LineSplitter } = require('../src/io');
const { safeStdio } = require('../src/children');

const size = (o) => Buffer.byteLength(JSON.stringify(o));

test('cut: every limit is respected exactly, whatever the characters', () => {
  const alphabet = ['a', 'é', '€', '😀', '"', '\\', '\n', '\u0001', '\u2028', '\ud800'];
  for (const ch of alphabet) {
    const text = `${ch}x`.repeat(3000);
    const result = { status: 'ok', content: [{ type: 'text', text }, { type: 'text', text: 'tail' }], isError: false };
    for (const max of [300, 1000, 4097, 9000]) {
      if (size(result) <= max) continue; // encodeResult only cuts what is over
      const out = results.cut(result, max);
      assert.ok(size(out) <= max, `${JSON.stringify(ch)} @${max}: ${size(out)}`);
      assert.ok(size(out) > max - 16, `${JSON.stringify(ch)} @${max} uses the room: ${size(out)}`);
      assert.equal(out.content.length, 2, 'cut block + note (the tail after a cut is dropped)');
      assert.ok(text.startsWith(out.content[0].text));
      assert.match(out.content.at(-1).text, new RegExp(`^\\[result cut at ${max} bytes by sandboxd: write large output to a file \\(output_path\\) and return a summary\\]$`));
    }
  }
});

test('cut: never splits a surrogate pair', () => {
  const text = '😀'.repeat(1000);
  for (let max = 200; max < 260; max++) {
    const out = results.cut({ status: 'ok', content: [{ type: 'text', text }], isError: false }, max);
    const cutText = out.content[0] ? out.content[0].text : '';
    if (out.content.length === 2) assert.equal(cutText.length % 2, 0);
    assert.ok(!/[\ud800-\udbff]$/.test(cutText));
  }
});

test('cut: details and images go when the rest alone does not fit', () => {
  const r = {
    status: 'ok',
    content: [{ type: 'image', data: 'A'.repeat(5000), mimeType: 'image/png' }, { type: 'text', text: 'x'.repeat(5000) }],
    isError: false,
    details: { blob: 'y'.repeat(5000) },
  };
  const out = results.cut(r, 3000);
  assert.ok(size(out) <= 3000);
  assert.equal(out.details, undefined);
  assert.ok(out.content.every((b) => b.type === 'text'));
  assert.match(out.content.at(-1).text, /\(details and image blocks dropped\)/);
  const keep = results.cut(r, 12000);
  assert.ok(size(keep) <= 12000);
  assert.deepEqual(keep.details, r.details);
  assert.equal(keep.content[0].type, 'image');
});

test('encodeResult: unserializable results become error results', () => {
  const big = JSON.parse(results.encodeResult({ status: 'ok', content: [{ type: 'text', text: 'x' }], isError: false, details: 1n }, 1000));
  assert.equal(big.status, 'error');
  assert.match(big.content[0].text, /BigInt/);
  const loop = { a: 1 };
  loop.loop = loop;
  const circ = JSON.parse(results.encodeResult({ status: 'ok', content: [{ type: 'text', text: 'x' }], isError: false, details: loop }, 1000));
  assert.match(circ.content[0].text, /circular/);
});

test('progressContent coerces whatever onUpdate gets', () => {
  assert.deepEqual(results.progressContent('hi'), [{ type: 'text', text: 'hi' }]);
  assert.deepEqual(results.progressContent({ content: [{ type: 'text', text: 'a' }] }), [{ type: 'text', text: 'a' }]);
  assert.deepEqual(results.progressContent({ type: 'text', text: 'b' }), [{ type: 'text', text: 'b' }]);
  assert.deepEqual(results.progressContent(['c', 3]), [{ type: 'text', text: 'c' }, { type: 'text', text: '3' }]);
  assert.deepEqual(results.progressContent(undefined), []);
  assert.deepEqual(results.progressContent(7), [{ type: 'text', text: '7' }]);
  assert.deepEqual(results.progressContent({ pct: 50 }), [{ type: 'text', text: '{ pct: 50 }' }]);
});

test('thrownMessage: Bun, named errors, plain errors, non-errors', () => {
  assert.equal(results.thrownMessage(new ReferenceError('Bun is not defined')), results.BUN_MESSAGE);
  assert.equal(results.thrownMessage(new Error('plain')), 'plain');
  assert.equal(results.thrownMessage(new TypeError('bad')), 'TypeError: bad');
  assert.equal(results.thrownMessage('str'), 'str');
  assert.equal(results.thrownMessage(42), 'execute threw 42');
  assert.equal(results.thrownMessage(new ReferenceError('foo is not defined')), 'ReferenceError: foo is not defined');
});

test('fromReturn: valid results pass through, isError sets status', () => {
  const ok = results.fromReturn({ content: [{ type: 'text', text: 'a', extra: 1 }], details: { d: 1 } });
  assert.deepEqual(ok, { status: 'ok', content: [{ type: 'text', text: 'a', extra: 1 }], isError: false, details: { d: 1 } });
  assert.equal(results.fromReturn({ content: [], isError: true }).status, 'error');
  assert.equal(results.fromReturn({ content: [{ type: 'image', data: 'x' }] }).status, 'error');
});

test('LineSplitter splits on \\n only, drops \\r and blank lines, survives chunking', () => {
  const lines = [];
  let tooLong = 0;
  const s = new LineSplitter((l) => lines.push(l), () => tooLong++, 64);
  const payload = Buffer.from('{"a":"x\u2028y"}\r\n\n  \n{"b":"é"}\n');
  for (const byte of payload) s.push(Buffer.from([byte])); // split inside a UTF-8 sequence too
  assert.deepEqual(lines, ['{"a":"x\u2028y"}', '{"b":"é"}']);
  s.push(Buffer.from(`${'z'.repeat(100)}`));
  s.push(Buffer.from('zzz\n{"c":1}\n'));
  assert.equal(tooLong, 1);
  assert.deepEqual(lines.at(-1), '{"c":1}');
});

test('safeStdio (fallback child_process patch) keeps children off fds 0/1', () => {
  assert.deepEqual(safeStdio('inherit'), ['ignore', 2, 'inherit']);
  assert.deepEqual(safeStdio(['inherit', 'inherit', 'pipe']), ['ignore', 2, 'pipe']);
  assert.deepEqual(safeStdio([0, 1, 2]), ['ignore', 2, 2]);
  assert.deepEqual(safeStdio([process.stdin, process.stdout, 'inherit']), ['ignore', 2, 'inherit']);
  assert.equal(safeStdio('pipe'), 'pipe');
  assert.equal(safeStdio(undefined), undefined);
  assert.deepEqual(safeStdio(undefined, true), ['ignore', 2, 'inherit', 'ipc']);
});

test('toolStack: the tool\'s frames stay, the shim\'s and Node\'s below them go', () => {
  const shim = require('node:path').join(__dirname, '..', 'src');
  const e = new Error('the service is down');
  e.stack = [
    'Error: the service is down',
    '    at fetchWeather (/officer/user/tools/weather/lib.ts:3:9)',
    `    at fetch (${shim}/egress.js:10:2)`,
    '    at async Object.execute (/officer/user/tools/weather/index.ts:8:3)',
    `    at ${shim}/main.js:216:22`,
    '    at AsyncLocalStorage.run (node:async_hooks:346:14)',
    `    at handleCall (${shim}/main.js:206:35)`,
    '    at Socket.emit (node:events:524:28)',
  ].join('\n');
  assert.equal(results.toolStack(e), [
    'Error: the service is down',
    '    at fetchWeather (/officer/user/tools/weather/lib.ts:3:9)',
    `    at fetch (${shim}/egress.js:10:2)`,
    '    at async Object.execute (/officer/user/tools/weather/index.ts:8:3)',
  ].join('\n'));
  assert.equal(results.toolStack('a thrown string'), 'a thrown string');
  const own = new Error('x');
  own.stack = `Error: x\n    at resolveExecute (${shim}/result.js:60:9)\n    at node:internal/x:1:1`;
  assert.equal(results.toolStack(own), 'Error: x');
});
