'use strict';
// openTunnel (src/egress.js) against proxies that answer oddly: what comes back is
// never trusted. install() patches this test process's http/https and fetch, which
// nothing here uses (node --test runs each file in a process of its own).
const { test, before, after } = require('node:test');
const assert = require('node:assert/strict');
const fs = require('node:fs');
const os = require('node:os');
const path = require('node:path');
const egress = require('../src/egress');
const { listenFakeProxy } = require('./fake-proxy');

const dir = fs.mkdtempSync(path.join(os.tmpdir(), 'sandboxd-tunnel-'));
const socketPath = path.join(dir, 'egress.sock');
let respond = null; // (socket, requestHead) => void, set by each test for its next request
// A request no test expected gets this, so that a test fails instead of waiting forever.
const unexpected = (sock) => sock.end('HTTP/1.1 599 Unexpected\r\nContent-Length: 0\r\n\r\n');
const heads = [];
let server;

before(async () => {
  server = await listenFakeProxy(socketPath, (sock, head) => {
    heads.push(head);
    const r = respond || unexpected;
    respond = null;
    r(sock, head);
  });
  await egress.install(socketPath, () => {});
});

after(() => {
  server.close();
  fs.rmSync(dir, { recursive: true, force: true });
});

test('CONNECT names the host as given, IPv6 in brackets', async () => {
  for (const [host, want] of [['example.test', 'example.test:443'], ['::1', '[::1]:8080'], ['[fe80::1]', '[fe80::1]:80']]) {
    respond = (sock) => sock.write('HTTP/1.1 200 Connection established\r\n\r\n');
    const port = Number(want.split(':').pop());
    const sock = await egress.openTunnel(host, port);
    sock.destroy();
    assert.equal(heads[heads.length - 1], `CONNECT ${want} HTTP/1.1\r\nHost: ${want}`);
  }
});

test('bytes after the 200 head belong to the tunnel: they are read first', { timeout: 10000 }, async () => {
  respond = (sock) => sock.write('HTTP/1.1 200 Connection established\r\n\r\nEARLY');
  const sock = await egress.openTunnel('example.test', 80);
  const first = await new Promise((r) => sock.once('data', r));
  assert.equal(first.toString(), 'EARLY');
  sock.destroy();
});

test('a refusal: the one-line body is the message, control characters dropped', async () => {
  respond = (sock) => sock.end('HTTP/1.1 403 Forbidden\r\nX-Sandboxd-Egress: refused\r\nContent-Length: 40\r\n\r\negress to x:80 refused\x1b[31m by policy\nsecond line');
  await assert.rejects(egress.openTunnel('x', 80), (e) => {
    assert.equal(e.code, 'EGRESS_REFUSED');
    assert.equal(e.message, 'egress to x:80 refused [31m by policy');
    assert.equal(e.status, 403);
    return true;
  });
});

test('a 403 without the refused header is a failure, not a policy refusal', async () => {
  respond = (sock) => sock.end('HTTP/1.1 403 Forbidden\r\nContent-Length: 0\r\n\r\n');
  await assert.rejects(egress.openTunnel('x', 80), {
    code: 'EGRESS_FAILED',
    message: 'egress to x:80 failed: sandboxd\'s egress proxy answered "HTTP/1.1 403 Forbidden"',
  });
});

test('a head over 16 KiB is cut off, not buffered without end', async () => {
  respond = (sock) => sock.write(`HTTP/1.1 200 OK\r\nX: ${'a'.repeat(20000)}`);
  await assert.rejects(egress.openTunnel('x', 80), { code: 'EGRESS_FAILED', message: /response head over 16384 bytes/ });
});

test('not HTTP, or closed without an answer: failures that say so', async () => {
  respond = (sock) => sock.end('SSH-2.0-hello\r\n\r\n');
  await assert.rejects(egress.openTunnel('x', 80), { code: 'EGRESS_FAILED', message: /did not answer in HTTP\/1\.1/ });
  respond = (sock) => sock.end();
  await assert.rejects(egress.openTunnel('x', 80), { code: 'EGRESS_FAILED', message: /closed the connection without answering/ });
});

test('a host that could break the CONNECT line is refused before connecting', async () => {
  const before = heads.length;
  for (const host of ['a\r\nX-Evil: 1', 'a b', '', 'a/b', 'x'.repeat(300)]) {
    await assert.rejects(egress.openTunnel(host, 80), { code: 'EGRESS_FAILED', message: /not a valid host name/ });
  }
  await assert.rejects(egress.openTunnel('x', 70000), { code: 'EGRESS_FAILED', message: /port "70000" is not valid/ });
  assert.equal(heads.length, before);
});

test('an abort while waiting for the proxy rejects with the reason', async () => {
  const ac = new AbortController();
  respond = () => ac.abort(new Error('stop now'));
  await assert.rejects(egress.openTunnel('x', 80, ac.signal), { message: 'stop now' });
});

test('a proxy that is not there: a failure that names the socket', async () => {
  fs.renameSync(socketPath, `${socketPath}.away`);
  try {
    await assert.rejects(egress.openTunnel('x', 80), {
      code: 'EGRESS_FAILED',
      message: `egress to x:80 failed: sandboxd's egress proxy is not reachable at ${socketPath} (ENOENT)`,
    });
  } finally {
    fs.renameSync(`${socketPath}.away`, socketPath);
  }
});
