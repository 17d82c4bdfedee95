'use strict';
// sandboxd shim, protocol 2: line-delimited JSON-RPC 2.0 between the sandboxd
// daemon and the tools of one sandbox. See docs/shim.md.
//
// Transport: SANDBOXD_SHIM_SOCKET=PATH, a unix socket the daemon listens on; else
// SANDBOXD_SHIM_FDS="OUT,IN" (the image's entrypoint sets "3,4"); else the
// protocol is read from fd 0 and written to fd 1 (see io.setupFds).

// Must run before anything touches process.stdout / process.stdin.
const io = require('./io');

const fdSetup = io.setupFds(process.env);
const socketPath = process.env.SANDBOXD_SHIM_SOCKET;
delete process.env.SANDBOXD_SHIM_FDS;
delete process.env.SANDBOXD_SHIM_SOCKET;
// The egress proxy's socket (docs/shim.md, "Egress"); tools need not know it.
const egressSocket = process.env.SANDBOXD_EGRESS_SOCKET;
delete process.env.SANDBOXD_EGRESS_SOCKET;
// Connect before any tool code can run: the daemon takes one connection per sandbox.
const connecting = socketPath
  ? io.connectSocket(socketPath, [fdSetup.inFd, fdSetup.outFd].filter((fd) => fd > 2))
  : null;

if (!fdSetup.isolated || fdSetup.fd1 === 'devnull') require('./children').install();
if (!fdSetup.isolated) {
  // fd 0 still carries the protocol: children must not inherit it (children.js),
  // and a tool touching process.stdin must not start a second reader on it.
  const { Readable } = require('node:stream');
  let emptyStdin = null;
  Object.defineProperty(process, 'stdin', {
    configurable: true,
    enumerable: false,
    get: () => (emptyStdin ||= Readable.from([])),
  });
}

const { AsyncLocalStorage } = require('node:async_hooks');
const output = require('./output');
const loader = require('./loader');
const results = require('./result');
const leftovers = require('./leftovers');

const PROTOCOL = 2;
const DEFAULT_MAX_RESULT_BYTES = 1024 * 1024;
const MAX_LINE_BYTES = 64 * 1024 * 1024;

process.setSourceMapsEnabled(true);

/** @type {null | {id:any, key:string, toolCallId:string, ac:AbortController, done:boolean, maxResultBytes:number, savedEnv:Array<[string,string|undefined]>, printed:number}} */
let current = null;
let lastToolCallId = null;
let calls = 0;
// True during the warm-up (warmUp below): nothing may reach the protocol.
let warmingUp = false;
// The call whose code is running: timers and promises keep it, so a stray error
// can be told apart from one thrown by a call that was already answered.
const callScope = new AsyncLocalStorage();

const out = output.install(
  () => (current ? current.toolCallId : lastToolCallId ? `${lastToolCallId} (finished)` : 'shim'),
  (stream, n) => {
    if (stream === 'stdout' && current) current.printed += n;
  },
);
const log = out.log;

// Before any tool code runs: fetch, http(s) and child processes go through the proxy.
const egress = egressSocket ? require('./egress') : null;
const egressReady = egress ? egress.install(egressSocket, log) : null;
const relay = egress ? require('./relay') : null;

const precompiledDir = process.env.SANDBOXD_TRANSPILE_CACHE;
delete process.env.SANDBOXD_TRANSPILE_CACHE;
loader.install({ warn: (m) => out.callLog(m), toolsDirs: process.env.PI_TOOLS_DIRS, precompiledDir });

// stderr gone (the daemon that read it died, or a tool closed fd 2): nobody can hear this
// shim any more. Reporting the EPIPE as a stray error would write to stderr again, and
// fail again, for ever (seen: an orphaned shim at 84% CPU). Exit instead.
process.stderr.on('error', (e) => {
  if (e && (e.code === 'EPIPE' || e.code === 'EBADF')) process.exit(0);
});

// ---------------------------------------------------------------- protocol out

function writeLine(text) {
  if (warmingUp) return; // the warm-up's call is nobody's
  try {
    io.writeAll(fdSetup.outFd, Buffer.from(`${text}\n`, 'utf8'));
  } catch (e) {
    if (e && (e.code === 'EPIPE' || e.code === 'EBADF')) {
      log(`protocol output closed (${e.code}); exiting`);
      process.exit(0);
    }
    throw e;
  }
}

function send(obj) {
  writeLine(JSON.stringify(obj));
}

function reply(id, result) {
  send({ jsonrpc: '2.0', id, result });
}

function replyError(id, code, message, data) {
  const error = { code, message };
  if (data !== undefined) error.data = data;
  send({ jsonrpc: '2.0', id: id === undefined ? null : id, error });
}

// ---------------------------------------------------------------- calls

function applyEnv(call, env) {
  for (const [k, v] of Object.entries(env)) {
    if (egress && egress.isProxyEnv(k)) {
      // Child processes have no other way out: a user's HTTP_PROXY would only break them.
      out.callLog(`env ${k} ignored: the shim points it at sandboxd's egress proxy`);
      continue;
    }
    call.savedEnv.push([k, Object.prototype.hasOwnProperty.call(process.env, k) ? process.env[k] : undefined]);
    if (v === null) delete process.env[k];
    else process.env[k] = String(v);
  }
}

function restoreEnv(call) {
  for (let i = call.savedEnv.length - 1; i >= 0; i -= 1) {
    const [k, old] = call.savedEnv[i];
    if (old === undefined) delete process.env[k];
    else process.env[k] = old;
  }
  call.savedEnv = [];
}

/** Send the call's one and only result; later settles are ignored. */
function finish(call, result) {
  if (call.done) return false;
  call.done = true;
  if (current === call) current = null;
  restoreEnv(call);
  if (egress) {
    egress.reassertEnv(); // in case the tool changed them
    egress.setSecretHosts(null); // a stand-in is worth nothing after its call: tunnels again
  }
  if (relay) relay.endCall();
  let json = results.encodeResult(result, call.maxResultBytes);
  const helper = egress && egress.helperPid();
  const retire = leftovers.retireReason(helper ? [helper] : []);
  if (retire) {
    out.callLog(`sandbox retired: ${retire}`);
    json = `${json.slice(0, -1)},"retire":${JSON.stringify(retire)}}`;
  }
  writeLine(`{"jsonrpc":"2.0","id":${JSON.stringify(call.id)},"result":${json}}`);
  return true;
}

function sendProgress(call, partial) {
  if (call.done) {
    out.callLog(`onUpdate after the call finished: ignored`);
    return;
  }
  const content = results.encodeProgressContent(results.progressContent(partial), call.maxResultBytes);
  writeLine(`{"jsonrpc":"2.0","method":"progress","params":{"id":${JSON.stringify(call.id)},"content":${content}}}`);
}

function badParams(id, message) {
  replyError(id, -32602, `invalid params: ${message}`);
}

async function handleCall(msg) {
  const { id } = msg;
  const p = msg.params;
  if (!p || typeof p !== 'object' || Array.isArray(p)) return badParams(id, 'params must be an object');
  if (typeof p.entry !== 'string' || p.entry === '') return badParams(id, 'entry must be the absolute path of index.ts or index.js');
  if (p.toolCallId !== undefined && typeof p.toolCallId !== 'string') return badParams(id, 'toolCallId must be a string');
  const args = p.arguments === undefined || p.arguments === null ? {} : p.arguments;
  if (typeof args !== 'object' || Array.isArray(args)) return badParams(id, 'arguments must be an object');
  const env = p.env === undefined || p.env === null ? {} : p.env;
  if (typeof env !== 'object' || Array.isArray(env)) return badParams(id, 'env must be an object of strings');
  for (const [k, v] of Object.entries(env)) {
    if (k === '' || k.includes('=') || k.includes('\0')) return badParams(id, `env name ${JSON.stringify(k)} is not valid`);
    if (v !== null && typeof v !== 'string' && typeof v !== 'number' && typeof v !== 'boolean') {
      return badParams(id, `env value of ${k} must be a string`);
    }
  }
  let maxResultBytes = DEFAULT_MAX_RESULT_BYTES;
  if (p.maxResultBytes !== undefined && p.maxResultBytes !== null) {
    if (!Number.isInteger(p.maxResultBytes) || p.maxResultBytes <= 0) return badParams(id, 'maxResultBytes must be a positive integer');
    maxResultBytes = p.maxResultBytes;
  }
  if (current) {
    return replyError(id, -32000, `busy: call ${JSON.stringify(current.id)} (${current.toolCallId}) is still running; one call at a time`);
  }
  // The hosts of this call's secrets: their requests go to the egress proxy in absolute form.
  const hostsProblem = egress ? egress.setSecretHosts(p.egressSecretHosts) : null;
  if (hostsProblem) return badParams(id, hostsProblem);

  const toolCallId = p.toolCallId === undefined ? String(id) : p.toolCallId;
  const call = {
    id,
    key: JSON.stringify(id),
    toolCallId,
    ac: new AbortController(),
    done: false,
    maxResultBytes,
    savedEnv: [],
    printed: 0,
  };
  current = call;
  lastToolCallId = toolCallId;
  calls += 1;
  applyEnv(call, env);
  // Listening before the tool runs: it may connect at once.
  if (relay && p.browserRelay !== undefined) await relay.forCall(p.browserRelay, egress.openTunnel, out.callLog);

  let result;
  try {
    const value = await callScope.run(call, () => {
      let loaded;
      try {
        loaded = loader.load(p.entry);
      } catch (e) {
        throw results.loadFailure(e, p.entry);
      }
      const { mod, filename } = loaded;
      const execute = results.resolveExecute(mod, filename);
      const onUpdate = (partial) => sendProgress(call, partial);
      return execute.call(mod, toolCallId, args, call.ac.signal, onUpdate);
    });
    result = results.fromReturn(value, { printed: call.printed });
  } catch (e) {
    if (call.done) {
      out.callLog(`execute settled after its call was answered: ${results.thrownMessage(e)}`);
      return undefined;
    }
    out.callLog(`execute failed: ${results.toolStack(e)}`);
    result = results.errorResult(results.thrownMessage(e));
  }
  if (!finish(call, result)) out.callLog('execute settled after its call was answered (stray error); result dropped');
  return undefined;
}

function handleCancel(params) {
  if (!params || typeof params !== 'object' || !current) return;
  if (JSON.stringify(params.id) !== current.key) return;
  const reason = typeof params.reason === 'string' && params.reason !== '' ? params.reason : 'cancelled by sandboxd';
  out.callLog(`cancel: ${reason}`);
  if (!current.ac.signal.aborted) current.ac.abort(new DOMException(reason, 'AbortError'));
}

// A tool's stray async error: logged with the call it happened under and, when
// a call is running, fails that call (its execute may never settle otherwise).
// The shim itself keeps going.
function strayError(err, kind) {
  const text = results.thrownMessage(err);
  const stack = results.toolStack(err);
  const owner = callScope.getStore();
  if (owner && owner !== current) {
    // Left behind by a call that was already answered: not the running call's fault.
    out.callLog(current ? `${kind} from ${owner.toolCallId} (finished): ${stack}` : `${kind}: ${stack}`);
    return;
  }
  out.callLog(`${kind}: ${stack}`);
  if (current) {
    const hint = results.isBun(err)
      ? text
      : `${text} (an ${kind} in the tool's asynchronous code; catch errors inside execute and return { content: [...], isError: true })`;
    finish(current, results.errorResult(hint));
  }
}

process.on('uncaughtException', (err) => strayError(err, 'uncaught exception'));
process.on('unhandledRejection', (reason) => strayError(reason, 'unhandled rejection'));

// ---------------------------------------------------------------- dispatch

function hasId(msg) {
  return Object.prototype.hasOwnProperty.call(msg, 'id');
}

function validId(id) {
  return id === null || typeof id === 'string' || (typeof id === 'number' && Number.isFinite(id));
}

function onLine(line) {
  let msg;
  try {
    msg = JSON.parse(line);
  } catch (e) {
    replyError(null, -32700, `parse error: ${e.message}`);
    return;
  }
  if (!msg || typeof msg !== 'object' || Array.isArray(msg) || msg.jsonrpc !== '2.0' || typeof msg.method !== 'string') {
    const id = msg && typeof msg === 'object' && !Array.isArray(msg) && validId(msg.id) ? msg.id : null;
    replyError(id, -32600, 'invalid request: expected a JSON-RPC 2.0 object with a method');
    return;
  }
  if (hasId(msg) && !validId(msg.id)) {
    replyError(null, -32600, 'invalid request: id must be a string, a number or null');
    return;
  }
  const request = hasId(msg);
  switch (msg.method) {
    case 'ping':
      if (request) reply(msg.id, {});
      return;
    case 'call':
      if (!request) {
        log('call without an id ignored');
        return;
      }
      return handleCall(msg).catch((e) => strayError(e, 'shim error'));
    case 'cancel':
      handleCancel(msg.params);
      return;
    case 'shutdown':
      if (request) reply(msg.id, {});
      process.exit(0);
      return;
    case 'stats':
      // Debugging aid (not part of the protocol's contract): loader and leftover-check counters.
      if (request) {
        const { checks, walks } = leftovers.stats;
        reply(msg.id, { ...loader.stats, calls, busy: current !== null, leftoverChecks: checks, procWalks: walks });
      }
      return;
    default:
      if (request) replyError(msg.id, -32601, `unknown method: ${msg.method}`);
      else log(`unknown notification ignored: ${msg.method}`);
  }
}

// ---------------------------------------------------------------- start

// A fresh node compiles each function of the call path at its first use, and sets up
// hashing, AsyncLocalStorage, source maps and more then too: a new sandbox's first call took
// ~10 ms more than its second. The pool starts sandboxes ahead of need, so that work is done
// here, before `ready`, by a call of the shim's own tool (warm-up/index.ts) that no one sees.
// Its line also goes through a socket of its own (io.loopback), so a socket's first write
// and read are done too. Nothing reaches the protocol, no protocol input is read meanwhile
// (the reader starts after it), and the tool, its module and the counters are forgotten.
const WARMUP_ENTRY = `${__dirname}/warm-up/index.ts`;
const WARMUP_LINE = JSON.stringify({
  jsonrpc: '2.0', id: 'warm-up', method: 'call', params: { entry: WARMUP_ENTRY, toolCallId: 'warm-up', arguments: { name: 'sandboxd' }, env: {} },
});

async function warmUp() {
  const forget = loader.warmUp(WARMUP_ENTRY);
  const { checks, walks } = leftovers.stats;
  warmingUp = true;
  try {
    await onLine(WARMUP_LINE);
    // Second, so that a runtime without abstract sockets loses only this part. What comes
    // through the loopback goes nowhere: its peer could be anyone's.
    const lines = new io.LineSplitter(() => {}, () => {}, MAX_LINE_BYTES);
    await io.loopback(`${WARMUP_LINE}\n`, (chunk) => lines.push(chunk));
  } finally {
    warmingUp = false;
    forget();
    calls = 0;
    lastToolCallId = null;
    Object.assign(leftovers.stats, { checks, walks });
  }
}

async function openProtocol() {
  if (!connecting) return io.openReader(fdSetup.inFd);
  try {
    const { socket, fd } = await connecting;
    fdSetup.outFd = fd;
    return socket;
  } catch (e) {
    log(`cannot connect to the daemon's socket ${socketPath}: ${e.message}; exiting`);
    return process.exit(1);
  }
}

async function start() {
  if (fdSetup.note) log(fdSetup.note);
  const splitter = new io.LineSplitter(
    (line) => {
      try {
        onLine(line);
      } catch (e) {
        log(`internal error: ${e && e.stack ? e.stack : e}`);
        replyError(null, -32603, `internal error: ${e && e.message ? e.message : e}`);
      }
    },
    () => replyError(null, -32600, `message longer than ${MAX_LINE_BYTES} bytes skipped`),
    MAX_LINE_BYTES,
  );
  if (process.env.SANDBOXD_SHIM_WARMUP !== '0') {
    try {
      await warmUp();
    } catch (e) {
      log(`warm-up failed: ${e && e.stack ? e.stack : e}`);
    }
  }
  const input = await openProtocol();
  input.on('data', (chunk) => splitter.push(chunk));
  input.on('end', () => process.exit(0));
  input.on('error', (e) => {
    log(`protocol input failed: ${e.message}; exiting`);
    process.exit(0);
  });

  // esbuild's service starts before `ready` (about 35 ms): a sandbox that the pool
  // starts ahead of need is then fully warm when a call gets it, and a caller who
  // waits for a start pays the same either way (its first call needed the service).
  // Not with the daemon's transpile cache: the global tools need no esbuild, and an
  // idle sandbox without its service is ~MB smaller; a user's own tool starts it.
  if (process.env.SANDBOXD_SHIM_PREWARM !== '0' && !precompiledDir) {
    try {
      loader.prewarm();
    } catch (e) {
      log(`esbuild prewarm failed: ${e.message}`);
    }
  }

  if (egressReady) await egressReady; // child processes get HTTP_PROXY from the first call on
  send({ jsonrpc: '2.0', method: 'ready', params: { protocol: PROTOCOL, node: process.version, pid: process.pid } });
}

start().catch((e) => {
  log(`shim failed to start: ${e && e.stack ? e.stack : e}`);
  process.exit(1);
});
