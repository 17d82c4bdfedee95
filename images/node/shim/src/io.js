'use strict';
// Protocol file descriptors: where the shim reads requests and writes responses,
// and how the protocol is kept away from fds 0 and 1 (which tools and their child
// processes inherit and write to).
const fs = require('node:fs');
const net = require('node:net');
const tty = require('node:tty');

const { O_RDONLY, O_WRONLY, O_APPEND } = fs.constants;

/**
 * Decide the protocol fds.
 * - SANDBOXD_SHIM_FDS="OUT,IN" (the image's /bin/sh wrapper sets "3,4" after
 *   `3>&1 4<&0 1>&2 0</dev/null`): fds 0/1 already point at /dev/null and stderr.
 * - unset: the protocol arrives on fd 0 and leaves on fd 1. When both are pipes
 *   (a supervisor's subprocess pipes) the shim reopens them through /proc/self/fd
 *   as fresh close-on-exec fds, then puts /dev/null on fd 0 and stderr on fd 1, so
 *   a child process started with stdio 'inherit' can neither read the protocol
 *   nor write into it. Otherwise (socketpairs as Node's own spawn() makes, a tty,
 *   a file, no /proc) it stays on 0/1 (isolated: false) and the caller relies on
 *   the process.stdout/console patches and the child_process patch (children.js).
 * @returns {{inFd:number,outFd:number,mode:string,isolated:boolean,fd1?:string,note?:string}}
 */
function setupFds(env) {
  const spec = env.SANDBOXD_SHIM_FDS;
  if (spec !== undefined && spec !== '') {
    const m = /^\s*(\d+)\s*,\s*(\d+)\s*$/.exec(spec);
    if (!m) throw new Error(`SANDBOXD_SHIM_FDS must be "OUT,IN" such as "3,4", got ${JSON.stringify(spec)}`);
    return { outFd: Number(m[1]), inFd: Number(m[2]), mode: `fds ${m[1]},${m[2]}`, isolated: true };
  }
  try {
    return isolateStdio();
  } catch (e) {
    return { inFd: 0, outFd: 1, mode: 'stdio', isolated: false, note: `protocol stays on fds 0/1 (${e.message}); child processes started through child_process get /dev/null for an inherited stdin and stderr for an inherited stdout` };
  }
}

function isolateStdio() {
  const st0 = fs.fstatSync(0);
  const st1 = fs.fstatSync(1);
  if (!st0.isFIFO() || !st1.isFIFO()) throw new Error('stdin/stdout are not pipes');
  const inFd = fs.openSync('/proc/self/fd/0', O_RDONLY);
  let outFd;
  try {
    outFd = fs.openSync('/proc/self/fd/1', O_WRONLY);
  } catch (e) {
    fs.closeSync(inFd);
    throw e;
  }
  const a = fs.fstatSync(inFd);
  const b = fs.fstatSync(outFd);
  if (a.ino !== st0.ino || b.ino !== st1.ino) {
    fs.closeSync(inFd);
    fs.closeSync(outFd);
    throw new Error('/proc/self/fd reopened a different file');
  }
  // The lowest free fd is reused: close 0 and 1 and reopen them at once.
  fs.closeSync(0);
  const zero = fs.openSync('/dev/null', O_RDONLY);
  fs.closeSync(1);
  let one;
  let fd1 = 'stderr';
  try {
    one = fs.openSync('/proc/self/fd/2', O_WRONLY | O_APPEND);
  } catch {
    // stderr is a socket (cannot be reopened): raw fd 1 writes are dropped, and
    // the child_process patch sends inherited stdout to fd 2.
    one = fs.openSync('/dev/null', O_WRONLY);
    fd1 = 'devnull';
  }
  const note = zero === 0 && one === 1 ? undefined : `fd shuffle landed on ${zero},${one}`;
  return { inFd, outFd, mode: 'stdio (isolated)', isolated: true, fd1, note };
}

/**
 * Socket transport (SANDBOXD_SHIM_SOCKET=PATH): the daemon listens on a unix socket
 * bind-mounted into the sandbox, and the protocol runs over it instead of fds 3/4,
 * so a call no longer crosses dockerd and containerd-shim. The fds the wrapper made
 * from the container's stdin/stdout are closed first, so nothing in the sandbox can
 * write to the container's stdout any more.
 * @returns {Promise<{socket: net.Socket, fd: number}>}
 */
function connectSocket(path, closeFds) {
  for (const fd of closeFds) {
    try {
      fs.closeSync(fd);
    } catch {
      // already closed
    }
  }
  return new Promise((resolve, reject) => {
    const socket = net.createConnection({ path, allowHalfOpen: true });
    socket.once('error', reject);
    socket.once('connect', () => {
      socket.removeListener('error', reject);
      // Written synchronously with writeAll (as for a pipe), read through the socket.
      const fd = socket._handle && socket._handle.fd;
      if (typeof fd !== 'number' || fd < 0) {
        socket.destroy();
        reject(new Error('the protocol socket has no file descriptor'));
        return;
      }
      resolve({ socket, fd });
    });
  });
}

/** A readable stream over the protocol input fd. */
function openReader(fd) {
  const st = fs.fstatSync(fd);
  if (st.isFIFO() || st.isSocket()) {
    return new net.Socket({ fd, readable: true, writable: false, allowHalfOpen: true });
  }
  if (tty.isatty(fd)) return new tty.ReadStream(fd);
  return fs.createReadStream(null, { fd, autoClose: false });
}

/**
 * Send `text` to this process through a fresh pair of connected unix sockets: written with
 * writeAll, read through a net.Socket's 'data' events (onData), as the protocol is. Another
 * process in the network namespace may connect first and be the one read. The
 * warm-up (main.js) runs the protocol's first write and read on it: a fresh node's first
 * read of a socket took ~0.7 ms in a sandbox. The name is in the abstract namespace (Linux;
 * no file) and unique, and the listener closes at its first connection.
 * `text` must fit in the socket's buffer (keep it to a few kB): writeAll waits until all is
 * sent, and the reader is this same thread.
 * @returns {Promise<void>} settles once all of `text` was read
 */
function loopback(text, onData) {
  // Unique, not secret: what comes in is handed to onData, which must not trust it.
  const name = `\0sandboxd-shim-${process.pid}-${process.hrtime.bigint()}-${Math.random().toString(36).slice(2)}`;
  return new Promise((resolve, reject) => {
    const sockets = [];
    const server = net.createServer({ allowHalfOpen: true }, (peer) => {
      server.close();
      sockets.push(peer);
      peer.on('data', onData);
      peer.on('end', () => done());
      peer.on('error', done);
    });
    // The shim is not ready before this settles: never wait long for it.
    const timer = setTimeout(() => done(new Error('the loopback socket did not answer within 1 s')), 1000);
    function done(e) {
      clearTimeout(timer);
      server.close();
      for (const socket of sockets) socket.destroy();
      if (e) reject(e);
      else resolve();
    }
    server.once('error', done);
    server.listen({ path: name }, () => {
      const client = net.createConnection({ path: name }, () => {
        try {
          writeAll(client._handle.fd, Buffer.from(text, 'utf8'));
        } catch (e) {
          done(e);
        }
        client.end();
      });
      sockets.push(client);
      client.on('error', done);
    });
  });
}

const sleepCell = new Int32Array(new SharedArrayBuffer(4));

/**
 * Write all of buf to fd synchronously, in order. Handles short writes and
 * EAGAIN on a non-blocking pipe (waits 1 ms and retries) so a 1 MB line goes out
 * whole and never interleaves with another line.
 */
function writeAll(fd, buf) {
  let off = 0;
  while (off < buf.length) {
    try {
      off += fs.writeSync(fd, buf, off, buf.length - off);
    } catch (e) {
      if (e.code === 'EAGAIN' || e.code === 'EWOULDBLOCK') {
        Atomics.wait(sleepCell, 0, 0, 1);
        continue;
      }
      if (e.code === 'EINTR') continue;
      throw e;
    }
  }
}

/**
 * Split a byte stream into lines on "\n" only (U+2028/U+2029 are not line ends),
 * drop a trailing "\r", skip blank lines. Oversized lines are reported and skipped.
 */
class LineSplitter {
  constructor(onLine, onTooLong, maxBytes) {
    this.onLine = onLine;
    this.onTooLong = onTooLong;
    this.maxBytes = maxBytes;
    this.parts = [];
    this.size = 0;
    this.skipping = false;
  }

  push(chunk) {
    let start = 0;
    for (;;) {
      const nl = chunk.indexOf(10, start);
      if (nl === -1) break;
      const piece = chunk.subarray(start, nl);
      start = nl + 1;
      if (this.skipping) {
        this.skipping = false;
        continue;
      }
      let line;
      if (this.parts.length) {
        this.parts.push(piece);
        line = Buffer.concat(this.parts, this.size + piece.length);
        this.parts = [];
        this.size = 0;
      } else {
        line = piece;
      }
      this.emit(line);
    }
    if (start < chunk.length && !this.skipping) {
      const rest = chunk.subarray(start);
      this.parts.push(Buffer.from(rest));
      this.size += rest.length;
      if (this.size > this.maxBytes) {
        this.parts = [];
        this.size = 0;
        this.skipping = true;
        this.onTooLong();
      }
    }
  }

  emit(line) {
    let end = line.length;
    if (end && line[end - 1] === 13) end -= 1;
    const text = line.toString('utf8', 0, end);
    if (text.trim() === '') return;
    this.onLine(text);
  }
}

module.exports = { setupFds, connectSocket, openReader, loopback, writeAll, LineSplitter };
