'use strict';
// Egress for tools (docs/shim.md, "Egress"). A sandbox has no network of its own:
// everything leaves through sandboxd's egress proxy, an HTTP proxy on the unix
// socket SANDBOXD_EGRESS_SOCKET names, which resolves names itself and applies the
// operator's policy. So that tools need no change, this module sends through it:
//   - Node's fetch: a global undici dispatcher (loaded on the first fetch) whose
//     connector opens a CONNECT tunnel, then TLS for https;
//   - the http/https modules: every Agent's createConnection opens the tunnel
//     (patched when a tool first requires either: loading them costs ~1 MB);
//   - child processes (python3, curl): HTTP(S)_PROXY point at a loopback forwarder
//     that pipes each connection to the proxy's socket, byte for byte; while a
//     synchronous child runs (execSync), a perl helper accepts on the same socket.
// Requests to the hosts of the running call's secrets (egress.secrets: the call names
// them, never the values) do not tunnel: fetch and the http/https modules send them to
// the proxy in absolute form (`GET https://host/path`, plain text on the unix socket),
// so that the proxy can put the secrets' values where the tool's env had stand-ins; it
// makes the TLS connection itself. Child processes keep their tunnels (no values).
// Nothing here is a defence: the proxy decides, and a tool that goes around this
// module has no route anywhere. It only makes the way out the easy one, and the
// proxy's refusals readable.
const net = require('node:net');
const Module = require('node:module');
const path = require('node:path');
const childProcess = require('node:child_process');
const { pipeline } = require('node:stream');
const relay = require('./relay');

const MAX_HEAD_BYTES = 16 * 1024; // the proxy's response head; more is not the proxy
const MAX_BODY_BYTES = 4 * 1024; // of a refusal's body: one line of text is expected
const MAX_MESSAGE_CHARS = 1000;
// Node's bundled undici (behind fetch) and the npm package both read the global
// dispatcher from this symbol (lib/global.js), and set it only when it is undefined.
const GLOBAL_DISPATCHER = Symbol.for('undici.globalDispatcher.1');
const PROXY_ENV = ['HTTP_PROXY', 'HTTPS_PROXY', 'http_proxy', 'https_proxy'];
const NO_ROUTE_CODES = new Set(['ENETUNREACH', 'EHOSTUNREACH', 'EAI_AGAIN', 'ENOTFOUND']);
const NO_ROUTE_HINT =
  "a sandbox has no network of its own: HTTP and HTTPS go through sandboxd's egress proxy, which fetch, " +
  'the http/https modules and child processes that honour HTTP_PROXY/HTTPS_PROXY use';

let socketPath = null;
let proxyEnv = null; // { name: value } once the forwarder listens
let forwarder = null; // its net.Server
let helper = null; // the perl acceptor for synchronous children, once one ran
// The running call's secret hosts: [{ host: 'api.x.com' | '*.x.com', port: n | null }]
// and a BlockList of its networks; empty between calls.
let secretHosts = [];
let secretNetworks = null;
const VIA_PROXY = Symbol('sandboxd.egress.absoluteForm');

class EgressError extends Error {
  /** @param {'EGRESS_REFUSED'|'EGRESS_FAILED'} code */
  constructor(message, code, details = {}) {
    super(message);
    this.name = 'EgressError';
    this.code = code;
    Object.assign(this, details);
  }
}

/** `host:port` for the CONNECT line; IPv6 in brackets. Refuses what could break the line. */
function authorityOf(host, port) {
  let name = String(host);
  if (name.startsWith('[') && name.endsWith(']')) name = name.slice(1, -1);
  if (name === '' || name.length > 255 || !/^[A-Za-z0-9._~%:-]+$/.test(name)) {
    throw new EgressError(`egress to ${JSON.stringify(String(host))} failed: not a valid host name`, 'EGRESS_FAILED');
  }
  const p = Number(port);
  if (!Number.isInteger(p) || p < 1 || p > 65535) {
    throw new EgressError(`egress to ${name} failed: port ${JSON.stringify(String(port))} is not valid`, 'EGRESS_FAILED');
  }
  return { name, port: p, authority: name.includes(':') ? `[${name}]:${p}` : `${name}:${p}` };
}

/** The first line of what the proxy said, printable and short: it is untrusted. */
function oneLine(buf) {
  const text = buf.toString('utf8').split(/\r?\n/, 1)[0];
  // eslint-disable-next-line no-control-regex
  const clean = text.replace(/[\u0000-\u001f\u007f-\u009f]/g, ' ').trim();
  return clean.length > MAX_MESSAGE_CHARS ? `${clean.slice(0, MAX_MESSAGE_CHARS)}…` : clean;
}

function parseHead(head) {
  const lines = head.toString('latin1').split('\r\n');
  const m = /^HTTP\/1\.[01] (\d{3})(?: .*)?$/.exec(lines[0]);
  if (!m) return null;
  const headers = {};
  for (const line of lines.slice(1)) {
    const colon = line.indexOf(':');
    if (colon > 0) headers[line.slice(0, colon).trim().toLowerCase()] = line.slice(colon + 1).trim();
  }
  return { status: Number(m[1]), statusLine: oneLine(Buffer.from(lines[0], 'latin1')), headers };
}

/**
 * A byte tunnel to host:port through the egress proxy (CONNECT). Resolves with the
 * connected socket; rejects with an EgressError whose message is the proxy's one-line
 * answer. The name goes to the proxy as it is: no lookup happens here.
 * @returns {Promise<net.Socket>}
 */
function openTunnel(host, port, signal) {
  return new Promise((resolve, reject) => {
    if (socketPath === null) {
      reject(new EgressError(`egress to ${host}:${port} failed: the shim has no egress socket`, 'EGRESS_FAILED'));
      return;
    }
    let target;
    try {
      // The call's browser relay port on loopback is the relay's (relay.js), not the host's loopback.
      target = authorityOf(relay.tunnelHost(host, port) || host, port);
    } catch (e) {
      reject(e);
      return;
    }
    if (signal && signal.aborted) {
      reject(signal.reason);
      return;
    }
    const { authority } = target;
    const details = { host: target.name, port: target.port };
    const sock = net.connect(socketPath);
    let buf = Buffer.alloc(0);
    let answer = null; // the parsed head of a non-2xx answer, while its body comes
    let bodyWanted = 0;
    let settled = false;

    const cleanup = () => {
      sock.removeListener('readable', onReadable);
      sock.removeListener('error', onError);
      sock.removeListener('end', onEnd);
      if (signal) signal.removeEventListener('abort', onAbort);
    };
    const fail = (err) => {
      if (settled) return;
      settled = true;
      cleanup();
      sock.destroy();
      reject(err);
    };
    const refusal = () => {
      const body = buf.subarray(0, Math.min(buf.length, bodyWanted));
      const said = oneLine(body);
      const refused = answer.status === 403 && (answer.headers['x-sandboxd-egress'] || '').toLowerCase() === 'refused';
      const message = said || `egress to ${authority} failed: sandboxd's egress proxy answered "${answer.statusLine}"`;
      fail(new EgressError(message, refused ? 'EGRESS_REFUSED' : 'EGRESS_FAILED', { ...details, status: answer.status }));
    };
    function onData(chunk) {
      buf = buf.length ? Buffer.concat([buf, chunk]) : chunk;
      if (answer) {
        if (buf.length >= bodyWanted) refusal();
        return;
      }
      const end = buf.indexOf('\r\n\r\n');
      if (end === -1) {
        if (buf.length > MAX_HEAD_BYTES) {
          fail(new EgressError(`egress to ${authority} failed: sandboxd's egress proxy sent a response head over ${MAX_HEAD_BYTES} bytes`, 'EGRESS_FAILED', details));
        }
        return;
      }
      if (end > MAX_HEAD_BYTES) {
        fail(new EgressError(`egress to ${authority} failed: sandboxd's egress proxy sent a response head over ${MAX_HEAD_BYTES} bytes`, 'EGRESS_FAILED', details));
        return;
      }
      const head = parseHead(buf.subarray(0, end));
      const rest = buf.subarray(end + 4);
      if (!head) {
        fail(new EgressError(`egress to ${authority} failed: sandboxd's egress proxy did not answer in HTTP/1.1`, 'EGRESS_FAILED', details));
        return;
      }
      if (head.status === 200) {
        settled = true;
        // Without a 'readable' listener the stream is back as new (neither flowing nor
        // paused) for its next reader, and what came after the head is read first.
        cleanup();
        if (rest.length) sock.unshift(rest);
        resolve(sock);
        return;
      }
      answer = head;
      const length = Number(head.headers['content-length']);
      bodyWanted = Number.isInteger(length) && length >= 0 ? Math.min(length, MAX_BODY_BYTES) : MAX_BODY_BYTES;
      buf = rest;
      if (buf.length >= bodyWanted || buf.includes('\n')) refusal();
    }
    // Paused mode ('readable' and read()), not 'data': nothing is read past the head
    // and lost before the tunnel's reader takes over.
    function onReadable() {
      let chunk;
      while (!settled && (chunk = sock.read()) !== null) onData(chunk);
    }
    function onEnd() {
      if (answer) refusal();
      else fail(new EgressError(`egress to ${authority} failed: sandboxd's egress proxy closed the connection without answering`, 'EGRESS_FAILED', details));
    }
    function onError(e) {
      if (answer) {
        refusal();
        return;
      }
      const why = e && e.code ? e.code : String(e && e.message);
      fail(new EgressError(`egress to ${authority} failed: sandboxd's egress proxy is not reachable at ${socketPath} (${why})`, 'EGRESS_FAILED', details));
    }
    function onAbort() {
      fail(signal.reason);
    }
    sock.on('readable', onReadable);
    sock.on('error', onError);
    sock.on('end', onEnd);
    if (signal) signal.addEventListener('abort', onAbort, { once: true });
    sock.once('connect', () => sock.write(`CONNECT ${authority} HTTP/1.1\r\nHost: ${authority}\r\n\r\n`));
  });
}

/**
 * The call's secret hosts, as the daemon sends them (docs/shim.md, "call": egressSecretHosts).
 * Returns an error message for a malformed list, or null once set.
 */
function setSecretHosts(list) {
  secretHosts = [];
  secretNetworks = null;
  if (list === undefined || list === null) return null;
  if (!Array.isArray(list)) return 'egressSecretHosts must be an array';
  const hosts = [];
  const networks = new net.BlockList();
  let anyNetwork = false;
  for (const item of list) {
    if (!item || typeof item !== 'object') return 'egressSecretHosts items must be objects';
    const { port } = item;
    if (port !== null && port !== undefined && !(Number.isInteger(port) && port > 0 && port < 65536)) {
      return 'egressSecretHosts port must be a port number or null';
    }
    if (typeof item.host === 'string' && item.host !== '') {
      hosts.push({ host: item.host.toLowerCase(), port: port || null });
    } else if (typeof item.network === 'string') {
      const [address, bits] = item.network.split('/');
      const type = net.isIPv6(address) ? 'ipv6' : 'ipv4';
      try {
        networks.addSubnet(address, Number(bits), type);
      } catch (e) {
        return `egressSecretHosts network ${JSON.stringify(item.network)} is not valid`;
      }
      hosts.push({ network: true, port: port || null });
      anyNetwork = true;
    } else {
      return 'egressSecretHosts items need a host or a network';
    }
  }
  secretHosts = hosts;
  secretNetworks = anyNetwork ? networks : null;
  return null;
}

/** Does the running call have a secret whose value belongs to host:port? (The proxy decides again.) */
function isSecretHost(hostname, port) {
  if (secretHosts.length === 0) return false;
  const host = String(hostname).replace(/^\[(.*)\]$/, '$1').toLowerCase().replace(/\.$/, '');
  const ipType = net.isIP(host);
  for (const entry of secretHosts) {
    if (entry.port !== null && entry.port !== port) continue;
    if (entry.network) {
      if (ipType && secretNetworks && secretNetworks.check(host, ipType === 6 ? 'ipv6' : 'ipv4')) return true;
    } else if (entry.host.startsWith('*.')) {
      if (host.endsWith(entry.host.slice(1)) && host !== entry.host.slice(2)) return true;
    } else if (host === entry.host) {
      return true;
    }
  }
  return false;
}

/** A plain connection to the proxy's socket (for an absolute-form request). */
function proxyConnection(callback) {
  if (socketPath === null) {
    callback(new EgressError("egress failed: the shim has no egress socket", 'EGRESS_FAILED'));
    return;
  }
  const sock = net.connect(socketPath);
  const onError = (e) => callback(new EgressError(
    `egress failed: sandboxd's egress proxy is not reachable at ${socketPath} (${e.code || e.message})`, 'EGRESS_FAILED'));
  sock.once('error', onError);
  sock.once('connect', () => {
    sock.removeListener('error', onError);
    callback(null, sock);
  });
}

/** undici headers (an object, a flat array, or pairs) as pairs. */
function headerPairs(headers) {
  if (!headers) return [];
  if (Array.isArray(headers)) {
    if (headers.length && Array.isArray(headers[0])) return headers.map(([k, v]) => [k, v]);
    const pairs = [];
    for (let i = 0; i + 1 < headers.length; i += 2) pairs.push([headers[i], headers[i + 1]]);
    return pairs;
  }
  if (typeof headers[Symbol.iterator] === 'function') return Array.from(headers, ([k, v]) => [k, v]);
  return Object.entries(headers);
}

/** TLS over a tunnel, resolved once the handshake is done (what undici's connector expects). */
function tlsOver(socket, host, servername) {
  return new Promise((resolve, reject) => {
    const tlsSocket = require('node:tls').connect({
      socket,
      host, // checked against the certificate when there is no servername (an IP address)
      servername: servername && !net.isIP(servername) ? servername : undefined,
      ALPNProtocols: ['http/1.1'],
    });
    const onError = (e) => {
      tlsSocket.destroy();
      reject(e);
    };
    tlsSocket.once('error', onError);
    tlsSocket.once('secureConnect', () => {
      tlsSocket.removeListener('error', onError);
      resolve(tlsSocket);
    });
  });
}

/** undici's `connect` option: (opts, callback(err, socket)). */
function undiciConnect(opts, callback) {
  const secure = opts.protocol === 'https:';
  const port = Number(opts.port) || (secure ? 443 : 80);
  const host = opts.hostname.replace(/^\[(.*)\]$/, '$1');
  openTunnel(host, port)
    .then((socket) => (secure ? tlsOver(socket, host, opts.servername || host) : socket))
    .then((socket) => callback(null, socket), (err) => callback(err, null));
}

function installFetch() {
  // Loaded on the first fetch, not before: undici costs memory an idle sandbox need not pay.
  let dispatcher = null;
  Object.defineProperty(globalThis, GLOBAL_DISPATCHER, {
    configurable: true,
    enumerable: false,
    get() {
      if (dispatcher === null) {
        // The Agent alone: undici's index would also set a global dispatcher of its own.
        const Agent = require('undici/lib/dispatcher/agent');
        dispatcher = new (secretAware(Agent))({ connect: undiciConnect });
      }
      return dispatcher;
    },
    set(value) {
      // A tool's own setGlobalDispatcher (npm undici defines the property instead).
      dispatcher = value;
    },
  });

  const nodeFetch = globalThis.fetch;
  if (typeof nodeFetch !== 'function') return;
  // "fetch failed" alone hides why: say what the proxy said (the original stays the cause).
  globalThis.fetch = function fetch(input, init) {
    return nodeFetch(input, init).catch((e) => {
      const cause = e && e.cause;
      if (e instanceof TypeError && cause instanceof EgressError) {
        throw new TypeError(`${e.message}: ${cause.message}`, { cause });
      }
      throw e;
    });
  };
}

/**
 * An undici Agent that sends requests to the call's secret hosts to the proxy in absolute
 * form (a second Agent, whose connections are plain ones to the proxy's socket), the rest
 * through tunnels.
 */
function secretAware(Agent) {
  return class SecretAwareAgent extends Agent {
    dispatch(opts, handler) {
      let origin;
      try {
        origin = new URL(String(opts.origin));
      } catch (e) {
        return super.dispatch(opts, handler);
      }
      const port = Number(origin.port) || (origin.protocol === 'https:' ? 443 : 80);
      if (!isSecretHost(origin.hostname, port) || String(opts.path || '/')[0] !== '/') {
        return super.dispatch(opts, handler);
      }
      if (!this.viaProxy) {
        this.viaProxy = new Agent({ connect: (_options, callback) => proxyConnection(callback) });
      }
      const headers = headerPairs(opts.headers).filter(([k]) => !['host', 'connection'].includes(String(k).toLowerCase()));
      // One request per connection, as the proxy serves them: undici must not reuse it for
      // another host's request (all of them share the proxy's origin here).
      headers.unshift(['host', origin.host], ['connection', 'close']);
      return this.viaProxy.dispatch({
        ...opts,
        origin: 'http://sandboxd-egress',
        path: `${origin.protocol}//${origin.host}${opts.path || '/'}`,
        headers: headers.flat(),
      }, handler);
    }
  };
}

/** An Agent's createConnection that tunnels; the original one runs TLS (https) on top. */
function tunnelling(original, secure) {
  return function createConnection(options, callback) {
    // Sync callers (no callback) and unix sockets keep the original.
    if (typeof callback !== 'function' || options === null || typeof options !== 'object' || options.socketPath) {
      return original.apply(this, arguments);
    }
    if (options[VIA_PROXY]) { // absolute form, plain text to the proxy: it makes the TLS connection
      proxyConnection(callback);
      return undefined;
    }
    const host = options.host || options.hostname || 'localhost';
    const port = Number(options.port) || (secure ? 443 : 80);
    openTunnel(host, port).then((socket) => {
      if (!secure) {
        if (options.timeout) socket.setTimeout(options.timeout);
        callback(null, socket);
        return;
      }
      let tlsSocket;
      try {
        // https.Agent's own: TLS session reuse, servername, the caller's TLS options.
        tlsSocket = original.call(this, { ...options, socket });
      } catch (e) {
        socket.destroy();
        callback(e);
        return;
      }
      callback(null, tlsSocket);
    }, (err) => callback(err));
    return undefined;
  };
}

let agentsPatched = false;

function patchAgents() {
  if (agentsPatched) return;
  agentsPatched = true;
  const http = require('node:http');
  const https = require('node:https');
  http.Agent.prototype.createConnection = tunnelling(http.Agent.prototype.createConnection, false);
  https.Agent.prototype.createConnection = tunnelling(https.Agent.prototype.createConnection, true);
  const addRequest = http.Agent.prototype.addRequest; // https.Agent inherits it
  http.Agent.prototype.addRequest = function addRequestMaybeAbsolute(req, options, ...rest) {
    if (options && typeof options === 'object' && !options.socketPath) {
      const secure = this instanceof https.Agent;
      const host = String(options.host || options.hostname || 'localhost');
      const port = Number(options.port) || (secure ? 443 : 80);
      if (isSecretHost(host, port) && typeof req.path === 'string' && req.path.startsWith('/')) {
        const name = net.isIPv6(host) ? `[${host}]` : host;
        const absolute = `${secure ? 'https' : 'http'}://${name}${port === (secure ? 443 : 80) ? '' : `:${port}`}${req.path}`;
        if (req._header) { // already rendered (headers given as an array, or Expect): its request line
          req._header = req._header.replace(/^(\S+) \S+/, `$1 ${absolute}`);
        }
        req.path = absolute;
        return addRequest.call(this, req, { ...options, [VIA_PROXY]: true }, ...rest);
      }
    }
    return addRequest.call(this, req, options, ...rest);
  };
}

const AGENT_MODULES = new Set(['http', 'https', 'node:http', 'node:https']);

/**
 * Patch the Agents when http or https is first required, not before. Tools' code, ES
 * modules and dynamic import() included, reaches them through require (loader.js
 * compiles it to CommonJS); process.getBuiltinModule is the other way in.
 */
function installAgents() {
  const load = Module._load;
  Module._load = function _load(request) {
    if (!agentsPatched && AGENT_MODULES.has(request)) patchAgents();
    return load.apply(this, arguments);
  };
  const getBuiltinModule = process.getBuiltinModule; // Node >= 20.16
  if (typeof getBuiltinModule === 'function') {
    process.getBuiltinModule = function getBuiltin(id) {
      if (!agentsPatched && AGENT_MODULES.has(id)) patchAgents();
      return getBuiltinModule.call(this, id);
    };
  }
}

// A raw socket to an outside address fails at once (no route, no DNS), and one to a browser
// relay port the daemon refused finds no listener: say why.
function installNoRouteHint() {
  const destroy = net.Socket.prototype._destroy;
  net.Socket.prototype._destroy = function _destroy(err, cb) {
    const hint = err && (NO_ROUTE_CODES.has(err.code) ? NO_ROUTE_HINT : relay.hint(err));
    if (hint && typeof err.message === 'string' && !err.message.includes(hint)) {
      const old = err.message;
      err.message = `${old} (${hint})`;
      if (typeof err.stack === 'string') err.stack = err.stack.replace(old, err.message);
    }
    return destroy.call(this, err, cb);
  };
}

/** The loopback proxy for child processes: each connection piped to the egress socket. */
function startForwarder(log) {
  return new Promise((resolve) => {
    const server = net.createServer((client) => {
      const upstream = net.connect(socketPath);
      pipeline(client, upstream, client, () => {});
    });
    server.unref();
    server.once('error', (e) => {
      log(`egress: the loopback proxy for child processes did not start (${e.message}); they have no HTTP_PROXY`);
      resolve(null);
    });
    server.listen({ host: '127.0.0.1', port: 0 }, () => {
      forwarder = server;
      const url = `http://127.0.0.1:${server.address().port}`;
      proxyEnv = Object.fromEntries(PROXY_ENV.map((name) => [name, url]));
      reassertEnv();
      resolve(url);
    });
  });
}

/**
 * Before a synchronous child process: the shim's event loop stops until it exits, so
 * a second acceptor (perl, a few hundred kB, started once) serves the listening socket
 * meanwhile. Connections made before it runs wait in the socket's backlog.
 */
function ensureHelper(spawn) {
  if (!forwarder || (helper && helper.exitCode === null && helper.signalCode === null)) return;
  helper = spawn('perl', [path.join(__dirname, 'forwarder.pl'), socketPath], {
    stdio: ['pipe', 'ignore', 'inherit', forwarder._handle.fd],
  });
  helper.on('error', () => {}); // no perl: synchronous children wait, as without the helper
  helper.unref();
  helper.stdin.on('error', () => {});
  helper.stdin._handle.unref(); // its end, when the shim exits, stops the helper
}

/** The helper's pid while it runs (not a leftover of a tool's), or null. */
function helperPid() {
  return helper && helper.exitCode === null && helper.signalCode === null ? helper.pid : null;
}

function installSyncChildren() {
  const spawn = childProcess.spawn;
  for (const name of ['spawnSync', 'execSync', 'execFileSync']) {
    const orig = childProcess[name];
    childProcess[name] = function patched(...args) {
      ensureHelper(spawn);
      return orig.apply(this, args);
    };
    Object.defineProperty(childProcess[name], 'name', { value: name });
  }
  Module.syncBuiltinESMExports();
}

/** Put the proxy variables back (a tool may have changed them during its call). */
function reassertEnv() {
  if (proxyEnv) Object.assign(process.env, proxyEnv);
}

/** True for the variables the shim sets for child processes: a call's env does not change them. */
function isProxyEnv(name) {
  return proxyEnv !== null && PROXY_ENV.includes(name);
}

/**
 * Send fetch, http/https and child processes through the egress socket at `path`.
 * Returns a promise that settles once child processes have their proxy.
 */
function install(path, log) {
  socketPath = path;
  installFetch();
  installAgents();
  installNoRouteHint();
  installSyncChildren();
  return startForwarder(log);
}

module.exports = {
  install, openTunnel, isProxyEnv, reassertEnv, helperPid, setSecretHosts, EgressError, PROXY_ENV, NO_ROUTE_HINT,
};
