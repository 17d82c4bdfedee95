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

// Walking /proc costs ~15 µs a call in a sandbox (procfs readdir), a third of the shim's
// own share of a warm call. Two counters read through descriptors kept open (~1 µs each)
// say when it cannot find anything new: /proc/loadavg's last field, the last pid the
// kernel handed out in this pid namespace (every process and thread takes one), and the
// pids cgroup's count of tasks alive. If neither moved since a walk that found no strays,
// no process was started since, so none can be left over. A walk still runs at least
// every FULL_SCAN_EVERY checks, so that no coincidence (a pid counter wrapped exactly
// round while a thread exited) hides a stray for longer than that.
const FULL_SCAN_EVERY = 64;
const PIDS_CURRENT = ['/sys/fs/cgroup/pids/pids.current', '/sys/fs/cgroup/pids.current']; // cgroup v1, v2

function openCounter(paths) {
  for (const file of paths) {
    try {
      return fs.openSync(file, 'r');
    } catch {
      // not this cgroup layout
    }
  }
  return -1;
}

const counterFds = enabled ? [openCounter(['/proc/loadavg']), openCounter(PIDS_CURRENT)] : [];
const counterBuf = Buffer.alloc(128);
let quietAt = null; // the counters read before the last walk that found no strays
let checksSinceWalk = 0;
const stats = { checks: 0, walks: 0 };

function readCounters() {
  let text = '';
  for (const fd of counterFds) {
    if (fd < 0) return null; // without both, always walk
    try {
      const n = fs.readSync(fd, counterBuf, 0, counterBuf.length, 0);
      text += counterBuf.toString('latin1', 0, n).trim().split(' ').pop() + ' ';
    } catch {
      return null;
    }
  }
  return text;
}

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

/** Why this sandbox should not serve another call, or null. ~5 µs; ~20 µs when it walks /proc. */
function retireReason(own = []) {
  if (!enabled) return null;
  stats.checks += 1;
  const reasons = [];
  let strays = [];
  const counters = readCounters(); // before the walk: a process started during it moves them
  if (counters === null || counters !== quietAt || ++checksSinceWalk >= FULL_SCAN_EVERY) {
    stats.walks += 1;
    checksSinceWalk = 0;
    quietAt = null;
    try {
      strays = strayProcesses(own);
    } catch {
      // no /proc: nothing to say
    }
    if (strays.length === 0) quietAt = counters;
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

module.exports = { retireReason, strayProcesses, stats };
