'use strict';
// Keeps tool output off the protocol: process.stdout.write and
// process.stderr.write (and so console.*) both go to stderr, each line prefixed
// with the tool call it belongs to, e.g. "[call_1] hello".

/** Decode a write() chunk to text. */
function chunkText(chunk, encoding) {
  if (typeof chunk === 'string') {
    if (typeof encoding === 'string' && !/^utf-?8$/i.test(encoding) && Buffer.isEncoding(encoding)) {
      return Buffer.from(chunk, encoding).toString('utf8');
    }
    return chunk;
  }
  if (chunk instanceof Uint8Array) return Buffer.from(chunk.buffer, chunk.byteOffset, chunk.byteLength).toString('utf8');
  return String(chunk);
}

/**
 * @param {() => string} getTag  the current call's tag ("call_1"), evaluated per write
 * @param {(stream: 'stdout'|'stderr', bytes: number) => void} [onWrite]
 */
function install(getTag, onWrite) {
  const stderr = process.stderr;
  const raw = stderr.write.bind(stderr);
  const lineStart = { stdout: true, stderr: true };

  function tagged(which, text) {
    if (text === '') return '';
    const prefix = `[${getTag()}] `;
    let out = lineStart[which] ? prefix : '';
    const body = text.endsWith('\n') ? text.slice(0, -1) : text;
    out += body.replace(/\n/g, `\n${prefix}`);
    if (body.length !== text.length) out += '\n';
    lineStart[which] = text.endsWith('\n');
    return out;
  }

  function makeWrite(which) {
    return function write(chunk, encoding, cb) {
      if (typeof encoding === 'function') {
        cb = encoding;
        encoding = undefined;
      }
      const text = chunkText(chunk, encoding);
      if (onWrite) onWrite(which, text.length);
      return raw(tagged(which, text), cb);
    };
  }

  // In the default fd mode fd 1 already points at stderr, so touching
  // process.stdout here is harmless; this must run after io.setupFds().
  process.stdout.write = makeWrite('stdout');
  process.stderr.write = makeWrite('stderr');
  // Blocking writes, so a tool that prints faster than sandboxd reads (calls.output_rate_bytes)
  // waits on the full pipe instead of its writes being dropped or queued. libuv opens each stdio
  // pipe non-blocking, and fds 1 and 2 share one open file (the flag with it); that they were
  // blocking before was a side effect of esbuild's child (a libuv child makes its inherited stdio
  // blocking). With the transpile cache no esbuild starts, and a 24 MiB flood took 9 ms.
  for (const stream of [process.stdout, process.stderr]) {
    if (stream._handle && typeof stream._handle.setBlocking === 'function') stream._handle.setBlocking(true);
  }

  return {
    /** A shim message on stderr, never tagged with a call. */
    log(msg) {
      raw(`[sandboxd-shim] ${msg}\n`);
    },
    /** Text attributed to the current call (stack traces and the like). */
    callLog(msg) {
      const lead = lineStart.stderr ? '' : '\n';
      lineStart.stderr = true;
      raw(lead + tagged('stderr', msg.endsWith('\n') ? msg : `${msg}\n`));
    },
  };
}

module.exports = { install };
