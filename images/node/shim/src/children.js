'use strict';
// Fallback protection for the default fd mode when fds 0/1 could not be moved
// out of the way (they are sockets, ttys or files rather than pipes): child
// processes that would inherit stdin get /dev/null instead, and those that would
// inherit stdout write to stderr. Only needed then; the image's entrypoint and
// the pipe case fix the fds themselves (see io.setupFds).
const childProcess = require('node:child_process');

function fdOf(v) {
  if (v === 'inherit') return 'inherit';
  if (typeof v === 'number') return v;
  if (v && typeof v === 'object' && typeof v.fd === 'number') return v.fd;
  return undefined;
}

function safeStdio(stdio, forkDefault) {
  let list;
  if (stdio === undefined || stdio === null) {
    if (!forkDefault) return stdio;
    list = ['inherit', 'inherit', 'inherit', 'ipc'];
  } else if (typeof stdio === 'string') {
    if (stdio !== 'inherit') return stdio;
    list = ['inherit', 'inherit', 'inherit'];
  } else if (Array.isArray(stdio)) {
    list = stdio.slice();
  } else {
    return stdio;
  }
  const in0 = fdOf(list[0]);
  if (in0 === 'inherit' || in0 === 0) list[0] = 'ignore';
  const out1 = fdOf(list[1]);
  if (out1 === 'inherit' || out1 === 1) list[1] = 2;
  return list;
}

function patchOptions(args, optIndexOf, forkDefault) {
  const i = optIndexOf(args);
  const opts = i >= 0 && args[i] && typeof args[i] === 'object' && !Array.isArray(args[i]) ? args[i] : null;
  if (!opts) {
    if (!forkDefault) return args;
    const copy = args.slice();
    copy.splice(Math.max(i, 0), 0, { stdio: safeStdio(undefined, true) });
    return copy;
  }
  if (forkDefault && opts.silent) return args;
  const stdio = safeStdio(opts.stdio, forkDefault);
  if (stdio === opts.stdio) return args;
  const copy = args.slice();
  copy[i] = { ...opts, stdio };
  return copy;
}

// Where the options object sits: (cmd, options) or (file, [args], options).
const afterCommand = (args) => (Array.isArray(args[1]) ? 2 : 1);

let installed = false;

function install() {
  if (installed) return;
  installed = true;
  const wrap = (name, optIndexOf, forkDefault = false) => {
    const orig = childProcess[name];
    childProcess[name] = function patched(...args) {
      return orig.apply(this, patchOptions(args, optIndexOf, forkDefault));
    };
    Object.defineProperty(childProcess[name], 'name', { value: name });
  };
  wrap('spawn', afterCommand);
  wrap('spawnSync', afterCommand);
  wrap('execFile', afterCommand);
  wrap('execFileSync', afterCommand);
  wrap('execSync', () => 1);
  wrap('fork', afterCommand, true);
  // exec() takes no stdio option (always pipes), nothing to do.
  require('node:module').syncBuiltinESMExports();
}

module.exports = { install, safeStdio };
