'use strict';
// Requests to the running call's secret hosts (egress.secrets) go to the proxy in absolute
// form, plain text, so that it can put the values in; every other request tunnels. A fake
// proxy on a unix socket records what it is sent (node --test runs this file in a process
// of its own: install() patches its fetch and http/https).
const { test, before, after, afterEach } = require('node:test');
const assert = require('node:assert/strict');
const fs = require('node:fs');
const os = require('node:os');
const path = require('node:path');
const egress = require('../src/egress');
const { listenFakeProxy } = require('./fake-proxy');

const dir = fs.mkdtempSync(path.join(os.tmpdir(), 'sandboxd-secrets-'));
const socketPath = path.join(dir, 'egress.sock');
const heads = [];
let server;

before(async () => {
  // A tunnel is refused (so a test sees it was asked for); an absolute-form request answered.
  server = await listenFakeProxy(socketPath, (sock, head) => {
    heads.push(head);
    if (head.startsWith('CONNECT ')) {
      sock.end('HTTP/1.1 403 Forbidden\r\nX-Sandboxd-Egress: refused\r\nContent-Length: 8\r\n\r\ntunnel!\n');
    } else {
      sock.end('HTTP/1.1 200 OK\r\nContent-Length: 2\r\nConnection: close\r\n\r\nok');
    }
  });
  await egress.install(socketPath, () => {});
});

after(() => {
  server.close();
  fs.rmSync(dir, { recursive: true, force: true });
});

afterEach(() => egress.setSecretHosts(null));

function lastHead() {
  const lines = heads[heads.length - 1].split('\r\n');
  const headers = Object.fromEntries(lines.slice(1).map((l) => [l.split(':')[0].toLowerCase(), l.slice(l.indexOf(':') + 1).trim()]));
  return { line: lines[0], headers };
}

function get(mod, url, headers) {
  return new Promise((resolve, reject) => {
    mod.get(url, { headers }, (res) => {
      let body = '';
      res.on('data', (d) => { body += d; });
      res.on('end', () => resolve({ status: res.statusCode, body }));
    }).on('error', reject);
  });
}

test('fetch to a secret host: absolute form with its Host and headers, plain to the proxy', async () => {
  assert.equal(egress.setSecretHosts([{ host: 'api.example.test', port: null }, { host: '*.apify.test', port: 8443 }]), null);
  const res = await fetch('https://api.example.test/v1/run?token=STAND-IN', { headers: { Authorization: 'Bearer STAND-IN' } });
  assert.equal(res.status, 200);
  assert.equal(await res.text(), 'ok');
  const { line, headers } = lastHead();
  assert.equal(line, 'GET https://api.example.test/v1/run?token=STAND-IN HTTP/1.1');
  assert.equal(headers.host, 'api.example.test');
  assert.equal(headers.authorization, 'Bearer STAND-IN');
  assert.equal(headers.connection, 'close'); // never reused for another host's request
  await fetch('https://eu.apify.test:8443/x', { method: 'POST', body: 'b' });
  assert.equal(lastHead().line, 'POST https://eu.apify.test:8443/x HTTP/1.1');
  assert.equal(lastHead().headers.host, 'eu.apify.test:8443');
});

test('fetch elsewhere, on another port, or after the call: a tunnel as always', async () => {
  egress.setSecretHosts([{ host: 'api.example.test', port: 443 }]);
  for (const url of ['https://other.test/', 'http://api.example.test:8080/', 'https://example.test/']) {
    await assert.rejects(fetch(url), /tunnel!/);
    assert.match(lastHead().line, /^CONNECT /);
  }
  egress.setSecretHosts(null);
  await assert.rejects(fetch('https://api.example.test/'), /tunnel!/);
  assert.equal(lastHead().line, 'CONNECT api.example.test:443 HTTP/1.1');
});

test('the http and https modules: absolute form for secret hosts and networks, tunnels otherwise', async () => {
  const http = require('node:http');
  const https = require('node:https');
  egress.setSecretHosts([{ host: 'api.example.test', port: null }, { network: '10.1.2.0/24', port: 8080 }]);
  assert.deepEqual(await get(https, 'https://api.example.test/p?k=STAND-IN', { 'X-Key': 'STAND-IN' }), { status: 200, body: 'ok' });
  assert.equal(lastHead().line, 'GET https://api.example.test/p?k=STAND-IN HTTP/1.1');
  assert.equal(lastHead().headers['x-key'], 'STAND-IN');
  assert.equal(lastHead().headers.host, 'api.example.test');
  assert.deepEqual(await get(http, 'http://10.1.2.3:8080/q', {}), { status: 200, body: 'ok' });
  assert.equal(lastHead().line, 'GET http://10.1.2.3:8080/q HTTP/1.1');
  assert.deepEqual(await get(https, 'https://10.1.2.3:8080/q', {}), { status: 200, body: 'ok' });
  assert.equal(lastHead().line, 'GET https://10.1.2.3:8080/q HTTP/1.1');
  await assert.rejects(get(http, 'http://10.1.3.3:8080/q', {}), /tunnel!|socket hang up|403/);
  assert.equal(lastHead().line, 'CONNECT 10.1.3.3:8080 HTTP/1.1');
});

test('a malformed host list is refused with a message', () => {
  assert.match(egress.setSecretHosts('x'), /must be an array/);
  assert.match(egress.setSecretHosts([{ port: 5 }]), /need a host or a network/);
  assert.match(egress.setSecretHosts([{ host: 'a.test', port: 0 }]), /port number or null/);
  assert.match(egress.setSecretHosts([{ network: 'nope/99' }]), /not valid/);
});
