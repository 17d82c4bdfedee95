'use strict';
// The shim's side of egress (src/egress.js): a shim started with SANDBOXD_EGRESS_SOCKET
// sends fetch, http(s) and child processes through the proxy on that socket. The proxy
// here is a fake that speaks the contract (docs/shim.md, "Egress"): it records each
// request, tunnels names ending in .test to local servers, refuses refused.test (403)
// and fails down.test (502). Nothing leaves 127.0.0.1, and the fixture tool fails every
// name lookup (and counts it), so no DNS query is ever sent.
// Run: node --test images/node/shim/test/
const { test, describe, before, after } = require('node:test');
const assert = require('node:assert/strict');
const { spawn } = require('node:child_process');
const fs = require('node:fs');
const http = require('node:http');
const https = require('node:https');
const net = require('node:net');
const os = require('node:os');
const path = require('node:path');

const MAIN = path.join(__dirname, '..', 'src', 'main.js');
const TOOL = path.join(__dirname, 'fixtures', 'egress', 'index.ts');
const CERT = path.join(__dirname, 'tls', 'cert.pem');
const KEY = path.join(__dirname, 'tls', 'key.pem');
const TIMEOUT = 30000;

const REFUSAL = "egress to refused.test:80 refused by sandboxd's egress policy: private address (RFC 1918); the operator can allow it with egress.allow";

function answer(status, reason, kind, body) {
  const bytes = Buffer.from(`${body}\n`, 'utf8');
  return `HTTP/1.1 ${status} ${reason}\r\nX-Sandboxd-Egress: ${kind}\r\nContent-Type: text/plain; charset=utf-8\r\n` +
    `Content-Length: ${bytes.length}\r\nConnection: close\r\n\r\n${bytes}`;
}

/** Local http and https servers that say who they are and what they were asked. */
async function startServers() {
  const handler = (kind) => (req, res) => {
    res.setHeader('content-type', 'application/json');
    res.end(JSON.stringify({ server: kind, method: req.method, url: req.url, host: req.headers.host }));
  };
  const plain = http.createServer(handler('http'));
  const secure = https.createServer({ cert: fs.readFileSync(CERT), key: fs.readFileSync(KEY) }, handler('https'));
  await Promise.all([plain, secure].map((s) => new Promise((r) => s.listen(0, '127.0.0.1', r))));
  return { plain, secure, httpPort: plain.address().port, httpsPort: secure.address().port };
}

/** The fake egress proxy on a unix socket. */
async function startProxy(servers) {
  const dir = fs.mkdtempSync(path.join(os.tmpdir(), 'sandboxd-egress-'));
  const socketPath = path.join(dir, 'egress.sock');
  const requests = [];
  const decide = (host) => {
    if (host === 'refused.test') return answer(403, 'Forbidden', 'refused', REFUSAL);
    if (host === 'down.test') return answer(502, 'Bad Gateway', 'failed', `egress to ${host} failed: connection refused`);
    return null;
  };
  const server = net.createServer((client) => {
    let buf = Buffer.alloc(0);
    const onData = (chunk) => {
      buf = Buffer.concat([buf, chunk]);
      const end = buf.indexOf('\r\n\r\n');
      if (end === -1) return;
      client.removeListener('data', onData);
      const head = buf.subarray(0, end).toString('latin1');
      const rest = buf.subarray(end + 4);
      const [method, target] = head.split('\r\n')[0].split(' ');
      requests.push({ method, target });
      let host;
      let port;
      let upstreamHead = null;
      if (method === 'CONNECT') {
        const m = /^\[?([^\]]+?)\]?:(\d+)$/.exec(target);
        [host, port] = [m[1], Number(m[2])];
      } else {
        const url = new URL(target); // absolute form: what python and curl send for http://
        [host, port] = [url.hostname, Number(url.port) || 80];
        upstreamHead = `${method} ${url.pathname}${url.search} HTTP/1.1\r\n${head.split('\r\n').slice(1).join('\r\n')}\r\n\r\n`;
      }
      const refusal = decide(host);
      if (refusal) {
        client.end(refusal);
        return;
      }
      const upstream = net.connect(port === 443 ? servers.httpsPort : servers.httpPort, '127.0.0.1', () => {
        if (upstreamHead === null) client.write('HTTP/1.1 200 Connection established\r\n\r\n');
        else upstream.write(upstreamHead);
        if (rest.length) upstream.write(rest);
        client.pipe(upstream).pipe(client);
      });
      upstream.on('error', () => client.destroy());
      client.on('error', () => upstream.destroy());
    };
    client.on('data', onData);
  });
  await new Promise((r) => server.listen(socketPath, r));
  return { server, socketPath, requests, dir };
}

/** A shim child process over pipes, with a call helper. */
class Shim {
  constructor(env) {
    const base = { ...process.env };
    for (const k of ['HTTP_PROXY', 'HTTPS_PROXY', 'http_proxy', 'https_proxy', 'NO_PROXY', 'no_proxy', 'ALL_PROXY']) delete base[k];
    this.proc = spawn(process.execPath, [MAIN], {
      stdio: ['pipe', 'pipe', 'pipe'],
      env: { ...base, SANDBOXD_SHIM_FDS: '', NODE_EXTRA_CA_CERTS: CERT, ...env },
    });
    this.stderr = '';
    this.proc.stderr.on('data', (d) => (this.stderr += d));
    this.pending = new Map();
    this.nextId = 1;
    let buf = '';
    this.ready = new Promise((resolve) => {
      this.proc.stdout.on('data', (d) => {
        buf += d;
        let nl;
        while ((nl = buf.indexOf('\n')) !== -1) {
          const msg = JSON.parse(buf.slice(0, nl));
          buf = buf.slice(nl + 1);
          if (msg.method === 'ready') resolve(msg.params);
          else if (this.pending.has(msg.id)) this.pending.get(msg.id)(msg);
        }
      });
    });
  }

  request(method, params) {
    const id = this.nextId++;
    return new Promise((resolve, reject) => {
      const timer = setTimeout(() => reject(new Error(`no answer to ${method} in ${TIMEOUT} ms; stderr:\n${this.stderr}`)), TIMEOUT);
      this.pending.set(id, (msg) => {
        clearTimeout(timer);
        this.pending.delete(id);
        resolve(msg);
      });
      this.proc.stdin.write(`${JSON.stringify({ jsonrpc: '2.0', id, method, params })}\n`);
    });
  }

  /** Runs the egress fixture tool; returns its JSON report. */
  async tool(args, env, browserRelay) {
    const msg = await this.request('call', { entry: TOOL, arguments: args, env, browserRelay });
    assert.equal(msg.result && msg.result.status, 'ok', JSON.stringify(msg));
    return JSON.parse(msg.result.content[0].text);
  }

  rss() {
    return Number(/VmRSS:\s+(\d+)/.exec(fs.readFileSync(`/proc/${this.proc.pid}/status`, 'utf8'))[1]);
  }

  close() {
    this.proc.kill();
  }
}

let servers;
let proxy;
const shims = [];
function shim(env) {
  const s = new Shim(env);
  shims.push(s);
  return s;
}
const withEgress = () => shim({ SANDBOXD_EGRESS_SOCKET: proxy.socketPath });

before(async () => {
  servers = await startServers();
  proxy = await startProxy(servers);
});

after(() => {
  for (const s of shims) s.close();
  servers.plain.close();
  servers.secure.close();
  proxy.server.close();
  fs.rmSync(proxy.dir, { recursive: true, force: true });
});

/** A port nothing listens on now. */
function freePort() {
  return new Promise((resolve) => {
    const server = net.createServer().listen(0, '127.0.0.1', () => {
      const { port } = server.address();
      server.close(() => resolve(port));
    });
  });
}

/** The proxy requests made while fn ran. */
async function recorded(fn) {
  const from = proxy.requests.length;
  const value = await fn();
  return { value, requests: proxy.requests.slice(from) };
}

describe('with SANDBOXD_EGRESS_SOCKET', () => {
  let s;
  before(async () => {
    s = withEgress();
    await s.ready;
  });

  test('fetch over http goes through a CONNECT tunnel, the name unresolved', async () => {
    const { value, requests } = await recorded(() => s.tool({ op: 'fetch', url: 'http://example.test/a?b=1' }));
    assert.equal(value.ok, true, JSON.stringify(value));
    assert.deepEqual(JSON.parse(value.body), { server: 'http', method: 'GET', url: '/a?b=1', host: 'example.test' });
    assert.deepEqual(requests, [{ method: 'CONNECT', target: 'example.test:80' }]);
    assert.equal(value.lookups, 0);
  });

  test('fetch over https: TLS inside the tunnel, the certificate checked for the name', async () => {
    const { value, requests } = await recorded(() => s.tool({ op: 'fetch', url: 'https://example.test/secure' }));
    assert.equal(value.ok, true, JSON.stringify(value));
    assert.equal(JSON.parse(value.body).server, 'https');
    assert.deepEqual(requests, [{ method: 'CONNECT', target: 'example.test:443' }]);
    // A name the certificate does not hold fails TLS: the tunnel is no way around the check.
    const wrong = await s.tool({ op: 'fetch', url: 'https://wrong.test/' });
    assert.equal(wrong.ok, false);
    assert.match(wrong.cause, /altnames|Hostname\/IP does not match/i);
    assert.equal(wrong.lookups, 0);
  });

  for (const agent of ['global', 'false', 'new']) {
    for (const scheme of ['http', 'https']) {
      test(`${scheme}.get with agent ${agent} goes through the tunnel`, async () => {
        const url = `${scheme}://other.test/${agent}`;
        const { value, requests } = await recorded(() => s.tool({ op: 'get', url, agent }));
        assert.equal(value.ok, true, JSON.stringify(value));
        assert.deepEqual(JSON.parse(value.body), { server: scheme, method: 'GET', url: `/${agent}`, host: 'other.test' });
        assert.deepEqual(requests, [{ method: 'CONNECT', target: `other.test:${scheme === 'https' ? 443 : 80}` }]);
        assert.equal(value.lookups, 0);
      });
    }
  }

  test('a python3 child with urllib goes through the loopback forwarder (http: absolute form, https: CONNECT)', async () => {
    const plain = await recorded(() => s.tool({ op: 'python', url: 'http://example.test/py' }));
    assert.match(plain.value.out, /^status 200\n/, JSON.stringify(plain.value));
    assert.deepEqual(JSON.parse(plain.value.out.split('\n')[1]), { server: 'http', method: 'GET', url: '/py', host: 'example.test' });
    assert.deepEqual(plain.requests, [{ method: 'GET', target: 'http://example.test/py' }]);
    const secure = await recorded(() => s.tool({ op: 'python', url: 'https://example.test/pys' }, { SSL_CERT_FILE: CERT }));
    assert.match(secure.value.out, /^status 200\n/, JSON.stringify(secure.value));
    assert.equal(JSON.parse(secure.value.out.split('\n')[1]).server, 'https');
    assert.deepEqual(secure.requests, [{ method: 'CONNECT', target: 'example.test:443' }]);
  });

  test('a refusal is fetch failed with the policy named, the proxy answer as the cause', async () => {
    const value = await s.tool({ op: 'fetch', url: 'http://refused.test/' });
    assert.equal(value.ok, false);
    assert.equal(value.name, 'TypeError');
    assert.equal(value.message, `fetch failed: ${REFUSAL}`);
    assert.equal(value.cause, REFUSAL);
    assert.equal(value.causeCode, 'EGRESS_REFUSED');
    const failed = await s.tool({ op: 'fetch', url: 'https://down.test/' });
    assert.equal(failed.message, 'fetch failed: egress to down.test failed: connection refused');
    assert.equal(failed.causeCode, 'EGRESS_FAILED');
  });

  for (const agent of ['global', 'false', 'new']) {
    test(`a refusal is the request's error with agent ${agent}`, async () => {
      for (const scheme of ['http', 'https']) {
        const value = await s.tool({ op: 'get', url: `${scheme}://refused.test/`, agent });
        assert.equal(value.ok, false);
        assert.equal(value.message, REFUSAL);
        assert.equal(value.code, 'EGRESS_REFUSED');
      }
      const failed = await s.tool({ op: 'get', url: 'http://down.test/', agent });
      assert.equal(failed.code, 'EGRESS_FAILED');
      assert.equal(failed.message, 'egress to down.test failed: connection refused');
    });
  }

  test("python sees the proxy's refusal: the 403 and its one line", async () => {
    const value = await s.tool({ op: 'python', url: 'http://refused.test/' });
    assert.equal(value.out, `http-error 403\n${REFUSAL}\n\n`);
  });

  test('tools see the proxy variables, not the socket; a call env cannot change them', async () => {
    const { env } = await s.tool({ op: 'env' });
    assert.equal(env.SANDBOXD_EGRESS_SOCKET, null);
    assert.match(env.HTTP_PROXY, /^http:\/\/127\.0\.0\.1:\d+$/);
    for (const k of ['HTTPS_PROXY', 'http_proxy', 'https_proxy']) assert.equal(env[k], env.HTTP_PROXY);
    assert.equal(env.ALL_PROXY, null);
    const callEnv = { HTTP_PROXY: null, https_proxy: 'http://127.0.0.1:9', http_proxy: null, HTTPS_PROXY: '' };
    const during = await s.tool({ op: 'env' }, callEnv);
    assert.deepEqual(during.env, env);
    const py = await s.tool({ op: 'python', url: 'http://example.test/still' }, callEnv);
    assert.match(py.out, /^status 200\n/, JSON.stringify(py));
    assert.match(s.stderr, /env HTTP_PROXY ignored: the shim points it at sandboxd's egress proxy/);
  });

  test("the call's browser relay port: loopback connections and fetch go to the relay's name", async () => {
    const port = await freePort();
    const relay = { port };
    const { value, requests } = await recorded(() => s.tool({ op: 'fetch', url: `http://127.0.0.1:${port}/relay` }, {}, relay));
    assert.equal(value.ok, true, JSON.stringify(value));
    assert.equal(JSON.parse(value.body).url, '/relay');
    assert.deepEqual(requests, [{ method: 'CONNECT', target: `browser-relay.sandboxd.invalid:${port}` }]);
    // A raw connection finds the shim listening there for the call; the tunnel follows.
    const from = proxy.requests.length;
    const raw = await s.tool({ op: 'net', host: '127.0.0.1', port }, {}, relay);
    assert.equal(raw.ok, true, JSON.stringify(raw));
    while (proxy.requests.length === from) await new Promise((r) => setTimeout(r, 10));
    assert.deepEqual(proxy.requests.slice(from), [{ method: 'CONNECT', target: `browser-relay.sandboxd.invalid:${port}` }]);
    // Another port, and the same port in a call not given it: the host's loopback, as ever (a new
    // connection: fetch would reuse its pooled tunnel, which stays open as every tunnel does).
    const other = await recorded(() => s.tool({ op: 'get', url: `http://127.0.0.1:${port + 1}/`, agent: 'false' }, {}, relay));
    const after = await recorded(() => s.tool({ op: 'get', url: `http://127.0.0.1:${port}/`, agent: 'false' }));
    assert.deepEqual([...other.requests, ...after.requests],
      [{ method: 'CONNECT', target: `127.0.0.1:${port + 1}` }, { method: 'CONNECT', target: `127.0.0.1:${port}` }]);
    const closed = await s.tool({ op: 'net', host: '127.0.0.1', port });
    assert.equal(closed.code, 'ECONNREFUSED', JSON.stringify(closed)); // the listener went with its call
    assert.doesNotMatch(closed.message, /browser relay/);
  });

  test('a relay port the daemon refused has no listener, and the refusal says why', async () => {
    const port = await freePort();
    const error = `the browser relay is not reached on port ${port}: the port is outside integrations.browser_relay`;
    const refused = await s.tool({ op: 'net', host: '127.0.0.1', port }, {}, { port, error });
    assert.equal(refused.code, 'ECONNREFUSED', JSON.stringify(refused));
    assert.equal(refused.message, `connect ECONNREFUSED 127.0.0.1:${port} (${error})`);
  });

  test('no name was looked up in the shim, whatever the path', async () => {
    const value = await s.tool({ op: 'loaded' });
    assert.equal(value.lookups, 0);
  });
});

test('undici loads on the first fetch, not before', async () => {
  const s = withEgress();
  await s.ready;
  assert.equal((await s.tool({ op: 'loaded' })).undici, 0);
  assert.equal((await s.tool({ op: 'get', url: 'http://example.test/' })).ok, true);
  assert.equal((await s.tool({ op: 'loaded' })).undici, 0);
  assert.equal((await s.tool({ op: 'fetch', url: 'http://example.test/' })).ok, true);
  assert.ok((await s.tool({ op: 'loaded' })).undici > 0);
});

for (const how of ['builtin', 'import']) {
  test(`http(s) reached first through ${how === 'builtin' ? 'process.getBuiltinModule' : 'a dynamic import'} still tunnels`, async () => {
    const s = withEgress();
    await s.ready;
    const lazy = path.join(__dirname, 'fixtures', 'egress-lazy', 'index.ts');
    for (const scheme of ['http', 'https']) {
      const { value, requests } = await recorded(() => s.request('call', { entry: lazy, arguments: { how, url: `${scheme}://example.test/${how}` } }));
      assert.equal(value.result.content[0].text, `status 200 ${JSON.stringify({ server: scheme, method: 'GET', url: `/${how}`, host: 'example.test' })}`);
      assert.deepEqual(requests, [{ method: 'CONNECT', target: `example.test:${scheme === 'https' ? 443 : 80}` }]);
    }
  });
}

test('without SANDBOXD_EGRESS_SOCKET nothing is installed', async () => {
  const s = shim({});
  await s.ready;
  const { env } = await s.tool({ op: 'env' });
  assert.deepEqual(env, {
    HTTP_PROXY: null, HTTPS_PROXY: null, http_proxy: null, https_proxy: null, ALL_PROXY: null, SANDBOXD_EGRESS_SOCKET: null,
  });
  const { value, requests } = await recorded(async () => [
    await s.tool({ op: 'get', url: 'http://localhost:2/' }),
    await s.tool({ op: 'fetch', url: 'http://localhost:2/' }),
  ]);
  assert.deepEqual(requests, []);
  // Node resolves the name itself then (the tool's counting lookup refuses it): the
  // counter that the egress tests see at 0 does count.
  assert.equal(value[0].code, 'ENOTFOUND');
  assert.equal(value[1].message, 'fetch failed');
  assert.equal(value[1].lookups, 2, JSON.stringify(value));
  assert.equal((await s.tool({ op: 'loaded' })).undici, 0);
});

test('idle: egress loads no HTTP, TLS or undici module until a tool asks for one', async () => {
  // What keeps an idle shim with egress small (+0.4 MB RSS measured; loading http/https at start
  // was +1.4 MB, undici far more). Checked as what is loaded, not as RSS: two processes' RSS
  // differ by half a megabyte from run to run, and a clean CI run saw +1.07 MB.
  const plain = shim({});
  const egress = withEgress();
  await Promise.all([plain.ready, egress.ready]);
  const entry = path.join(__dirname, 'fixtures', 'loaded-modules', 'index.js');
  const loaded = async (s) => JSON.parse((await s.request('call', { entry, arguments: {} })).result.content[0].text);
  const [without, withIt] = [await loaded(plain), await loaded(egress)];
  process.stdout.write(`# idle RSS without egress ${plain.rss()} kB, with egress ${egress.rss()} kB\n`);
  assert.deepEqual(withIt, without);
  assert.deepEqual(withIt, { builtins: [], undici: 0 });
});
