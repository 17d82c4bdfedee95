'use strict';
// After each call: did the tool leave behind something that would break the next
// call in this sandbox? Processes still running (a fork bomb holding every pid, a
// detached helper mining on the sandbox's CPU) or a /tmp that is nearly full. The
// result then carries `retire` with the reason, and the daemon replaces the sandbox
// instead of reusing it (docs/shim.md).
//
// Only meaningful when the shim is the sandbox's main process (PID 1, or the child
// of the container's init): anywhere else /proc shows the host's processes and /tmp
// is the host's.
const fs = require('node:fs');

const TMPFS_MAGIC = 0x01021994;
const TMP_MIN_FREE = 0.1; // retire when less than this share of /tmp is free
const MAX_LISTED = 5;

const enabled = process.pid === 1 || process.ppid === 1;

/**
 * Processes other than init, the shim, its esbuild service and `own` (the shim's other
 * helpers' pids) that are not zombies.
 */
function strayProcesses(own = []) {
  const strays = [];
  for (const name of fs.readdirSync('/proc')) {
    const c = name.charCodeAt(0);
    if (c < 48 || c > 57) continue; // not a pid
    const pid = Number(name);
    if (pid === 1 || pid === process.pid || own.includes(pid)) continue;
    let stat;
    try {
      stat = fs.readFileSync(`/proc/${name}/stat`, 'latin1');
    } catch {
      continue; // exited meanwhile
    }
    // "pid (comm) state ppid ...": comm may hold spaces and parentheses.
    const close = stat.lastIndexOf(')');
    const comm = stat.slice(stat.indexOf('(') + 1, close);
    const [state, ppid] = stat.slice(close + 2).split(' ', 2);
    if (state === 'Z' || state === 'X') continue; // exited, waiting to be reaped
    if (Number(ppid) === process.pid && comm === 'esbuild') continue;
    strays.push(`${pid} ${comm}`);
  }
  return strays;
}

function tmpNearlyFull() {
  try {
    const st = fs.statfsSync('/tmp');
    if (st.type !== TMPFS_MAGIC || st.blocks === 0) return null;
    const free = st.bavail / st.blocks;
    return free < TMP_MIN_FREE ? `/tmp is ${Math.round((1 - free) * 100)}% full` : null;
  } catch {
    return null;
  }
}

/** Why this sandbox should not serve another call, or null. Cheap: ~20 µs. */
function retireReason(own = []) {
  if (!enabled) return null;
  const reasons = [];
  let strays = [];
  try {
    strays = strayProcesses(own);
  } catch {
    // no /proc: nothing to say
  }
  if (strays.length) {
    const listed = strays.slice(0, MAX_LISTED).join(', ');
    const more = strays.length > MAX_LISTED ? `, and ${strays.length - MAX_LISTED} more` : '';
    reasons.push(`${strays.length} process(es) still running after the call (${listed}${more})`);
  }
  const tmp = tmpNearlyFull();
  if (tmp) reasons.push(tmp);
  return reasons.length ? reasons.join('; ') : null;
}

module.exports = { retireReason, strayProcesses };
