'use strict';
// What a tool gave back, turned into protocol results: ToolResult validation,
// actionable messages for the TOOLS.md "Common Mistakes", JSON encoding and the
// maxResultBytes cut.
const path = require('node:path');
const util = require('node:util');

// Shared with sandboxd validate (sandboxd/dev/lint/syntax.py reads the same file).
const FIXES = require('./fixes.json');

const RETURN_HINT = FIXES.returnFix;
const EXPORT_HINT = FIXES.exportFix;
const BUN_MESSAGE = 'Bun is not defined: tools run on Node.js; use fs/child_process/setTimeout instead of Bun APIs';

function preview(value, max = 120) {
  let s;
  if (typeof value === 'string') s = JSON.stringify(value);
  else s = util.inspect(value, { depth: 2, breakLength: Infinity, maxArrayLength: 5, maxStringLength: max });
  return s.length > max ? `${s.slice(0, max - 1)}…` : s;
}

function isClass(fn) {
  return typeof fn === 'function' && /^class[\s{]/.test(Function.prototype.toString.call(fn));
}

function describeFunction(fn) {
  if (isClass(fn)) return `a class${fn.name ? ` (${fn.name})` : ''}`;
  return `a function${fn.name ? ` (${fn.name})` : ''}`;
}

/**
 * Find execute in a loaded module, or throw an Error whose message says what the
 * module exports instead and how to fix it.
 */
function resolveExecute(mod, filename) {
  const file = path.basename(filename);
  if (mod && (typeof mod === 'object' || typeof mod === 'function') && typeof mod.execute === 'function') {
    return mod.execute;
  }
  let what;
  if (typeof mod === 'function') {
    what = `${file} sets module.exports to ${describeFunction(mod)}, so there is no execute export`;
  } else if (mod === null || typeof mod !== 'object') {
    what = `${file} sets module.exports to ${preview(mod)}, so there is no execute export`;
  } else {
    const keys = Object.keys(mod).filter((k) => k !== '__esModule');
    const described = keys.map((k) => {
      const v = mod[k];
      if (typeof v === 'function') return `${k} (${isClass(v) ? 'class' : 'function'})`;
      return `${k} (${v === null ? 'null' : typeof v})`;
    });
    if (mod.execute !== undefined) {
      what = `${file} exports execute, but it is ${preview(mod.execute)}, not a function`;
    } else if (keys.length === 0) {
      what = `${file} does not export anything (a CLI entry point, or output printed with console.log, is never seen by the agent)`;
    } else {
      what = `${file} does not export execute; it exports: ${described.join(', ')}`;
      const def = mod.default;
      if (def && typeof def === 'object' && typeof def.execute === 'function') {
        what += '. Its default export has an execute method: the entry must export execute by name';
      } else if (keys.some((k) => isClass(mod[k]))) {
        what += '. Class-based tools are not supported';
      }
    }
  }
  const err = new Error(`${what}; ${EXPORT_HINT}`);
  err.name = 'ToolShapeError';
  throw err;
}

/** The text an agent sees for something thrown by a tool. */
function thrownMessage(e) {
  if (e && typeof e === 'object' && typeof e.message === 'string') {
    const name = typeof e.name === 'string' ? e.name : 'Error';
    if (/\bBun is not defined\b/.test(e.message) && (name === 'ReferenceError' || e instanceof ReferenceError)) {
      return BUN_MESSAGE;
    }
    if (name === 'ToolShapeError' || name === 'ToolLoadError') return e.message;
    if (name === 'Error' || name === '') return e.message || 'Error (no message)';
    return `${name}: ${e.message}`;
  }
  if (typeof e === 'string') return e;
  return `execute threw ${preview(e)}`;
}

// Frames of the shim itself (this folder) and of Node's internals: a tool's stack ends in them.
const SHIM_DIR = `${__dirname}${path.sep}`;
const FRAME = /^\s+at /;
const notTheTools = (line) =>
  line.includes(SHIM_DIR) || /\(node:|\bat node:|\(<anonymous>\)|\(index \d+\)$/.test(line);

/**
 * What the log shows of something a tool threw: its stack down to the tool's own last frame.
 * The frames below it are the shim's (the call's dispatch, the line reader, the socket),
 * the same ten at every call, which only hide the tool's frames.
 */
function toolStack(e) {
  const text = thrownMessage(e);
  if (!e || typeof e !== 'object' || typeof e.stack !== 'string') return text;
  const lines = e.stack.split('\n');
  let end = lines.length;
  while (end > 0 && FRAME.test(lines[end - 1]) && notTheTools(lines[end - 1])) end -= 1;
  // A stack of shim frames alone (an error the shim raised about the tool) keeps its first line only.
  return lines.slice(0, end).join('\n');
}

/** An error from loading an entry, with a message that says so. */
function loadFailure(e, entry) {
  if (e && e.name === 'ToolLoadError') return e;
  const text = thrownMessage(e);
  if (text === BUN_MESSAGE) return e;
  const err = new Error(`${text} (while loading ${entry})`);
  err.name = 'ToolLoadError';
  err.stack = e && typeof e.stack === 'string' ? e.stack : err.stack;
  return err;
}

function isBun(e) {
  return thrownMessage(e) === BUN_MESSAGE;
}

/** Why a value is not a ToolResult, or null when it is one. */
function notAToolResult(v) {
  if (v === undefined) return 'execute returned undefined';
  if (v === null) return 'execute returned null';
  if (typeof v === 'string') return `execute returned a string (${preview(v, 80)}), not a ToolResult`;
  if (typeof v === 'function') return `execute returned ${describeFunction(v)}, not a ToolResult`;
  if (typeof v !== 'object') return `execute returned a ${typeof v} (${preview(v, 80)}), not a ToolResult`;
  if (Array.isArray(v)) return `execute returned an array of ${v.length} item(s) instead of an object with a content array`;
  if (!('content' in v)) {
    const keys = Object.keys(v);
    return `execute returned an object without a content array (keys: ${keys.length ? keys.join(', ') : 'none'})`;
  }
  if (!Array.isArray(v.content)) return `execute returned { content: ${preview(v.content, 80)} }; content must be an array`;
  for (let i = 0; i < v.content.length; i += 1) {
    const b = v.content[i];
    const ok =
      b &&
      typeof b === 'object' &&
      ((b.type === 'text' && typeof b.text === 'string') ||
        (b.type === 'image' && typeof b.data === 'string' && typeof b.mimeType === 'string'));
    if (!ok) {
      return `content[${i}] is ${preview(b, 80)}, which is not a text block { type: "text", text: string } or an image block { type: "image", data: base64 string, mimeType: string }`;
    }
  }
  return null;
}

function errorResult(text) {
  return { status: 'error', content: [{ type: 'text', text }], isError: true };
}

/** Turn what execute returned into a protocol result. */
function fromReturn(v, { printed } = {}) {
  const problem = notAToolResult(v);
  if (problem) {
    const extra = v === undefined && printed ? ' (it printed to stdout, which the agent never sees)' : '';
    return errorResult(`${problem}${extra}; ${RETURN_HINT}`);
  }
  const isError = Boolean(v.isError);
  const out = { status: isError ? 'error' : 'ok', content: v.content, isError };
  if (v.details !== undefined) out.details = v.details;
  return out;
}

/** Coerce whatever a tool passed to onUpdate into a content array. */
function progressContent(partial) {
  const block = (b) => {
    if (typeof b === 'string') return { type: 'text', text: b };
    if (b && typeof b === 'object' && b.type === 'text' && typeof b.text === 'string') return b;
    if (b && typeof b === 'object' && b.type === 'image' && typeof b.data === 'string' && typeof b.mimeType === 'string') return b;
    return { type: 'text', text: typeof b === 'object' ? preview(b, 10000) : String(b) };
  };
  if (partial === undefined || partial === null) return [];
  if (typeof partial === 'string') return [{ type: 'text', text: partial }];
  if (Array.isArray(partial)) return partial.map(block);
  if (typeof partial === 'object') {
    if (Array.isArray(partial.content)) return partial.content.map(block);
    if (typeof partial.text === 'string') return [block({ type: 'text', ...partial })];
    return [block(partial)];
  }
  return [{ type: 'text', text: String(partial) }];
}

/** JSON.stringify that reports BigInt/circular/toJSON failures as an Error. */
function toJson(value) {
  try {
    return { json: JSON.stringify(value) };
  } catch (e) {
    const msg = e && e.message ? String(e.message).split('\n')[0] : String(e);
    return { error: msg };
  }
}

/** Bytes the string takes inside a JSON string literal (without the quotes). */
function jsonCharCost(s, i) {
  const c = s.charCodeAt(i);
  if (c < 0x20) return c === 8 || c === 9 || c === 10 || c === 12 || c === 13 ? [2, 1] : [6, 1];
  if (c === 0x22 || c === 0x5c) return [2, 1];
  if (c < 0x80) return [1, 1];
  if (c < 0x800) return [2, 1];
  if (c >= 0xd800 && c <= 0xdbff) {
    const d = s.charCodeAt(i + 1);
    if (d >= 0xdc00 && d <= 0xdfff) return [4, 2];
    return [6, 1];
  }
  if (c >= 0xdc00 && c <= 0xdfff) return [6, 1];
  return [3, 1];
}

/** Longest prefix of s whose JSON-escaped size is at most budget bytes. */
function prefixWithin(s, budget) {
  let used = 0;
  let i = 0;
  while (i < s.length) {
    const [bytes, chars] = jsonCharCost(s, i);
    if (used + bytes > budget) break;
    used += bytes;
    i += chars;
  }
  return s.slice(0, i);
}

function cutNote(max, dropped) {
  const what = dropped.length ? ` (${dropped.join(' and ')} dropped)` : '';
  return {
    type: 'text',
    text: `[result cut at ${max} bytes by sandboxd${what}: write large output to a file (output_path) and return a summary]`,
  };
}

/**
 * Cut a result so that its JSON takes at most max bytes: text blocks are
 * shortened (later ones first dropped), then details and image blocks go if the
 * rest alone does not fit. A note block says so.
 */
function cut(result, max) {
  const size = (o) => Buffer.byteLength(JSON.stringify(o));
  const dropped = [];
  let blocks = result.content.slice();
  let details = result.details;
  const shape = (content) => {
    const o = { status: result.status, content, isError: result.isError };
    if (details !== undefined) o.details = details;
    return o;
  };
  const skeleton = () => blocks.map((b) => (b.type === 'text' ? { ...b, text: '' } : b));
  const worstNote = cutNote(max, ['details', 'image blocks']);
  let fixed = size(shape([...skeleton(), worstNote]));
  if (fixed > max && details !== undefined) {
    details = undefined;
    dropped.push('details');
    fixed = size(shape([...skeleton(), worstNote]));
  }
  if (fixed > max && blocks.some((b) => b.type !== 'text')) {
    blocks = blocks.filter((b) => b.type === 'text');
    dropped.push('image blocks');
    fixed = size(shape([...skeleton(), worstNote]));
  }
  if (fixed > max) blocks = [];
  const note = cutNote(max, dropped);
  // Fill text blocks in order until one has to be cut; blocks after it go.
  // A second pass reclaims the room their empty skeletons took.
  const fill = (slack) => {
    let budget = max - size(shape([...skeleton(), note])) - slack;
    const content = [];
    let cutAt = -1;
    blocks.forEach((b, i) => {
      if (b.type !== 'text') {
        content.push(b);
        return;
      }
      if (cutAt !== -1) return;
      const text = prefixWithin(b.text, Math.max(budget, 0));
      budget -= Buffer.byteLength(JSON.stringify(text)) - 2;
      if (text !== b.text) cutAt = i;
      if (text !== '') content.push(text === b.text ? b : { ...b, text });
    });
    content.push(note);
    return { out: shape(content), cutAt };
  };
  for (let slack = 0; slack < 64; slack += 8) {
    const first = fill(slack);
    if (first.cutAt !== -1) {
      const all = blocks;
      blocks = all.filter((b, i) => i <= first.cutAt || b.type !== 'text');
      const second = fill(slack);
      if (size(second.out) <= max) return second.out;
      blocks = all;
    }
    if (size(first.out) <= max || blocks.length === 0) return first.out;
  }
  return shape([note]);
}

/**
 * Encode a result as JSON text for the wire, turning unserializable results into
 * error results and enforcing maxResultBytes.
 */
function encodeResult(result, maxBytes) {
  let { json, error } = toJson(result);
  if (error) {
    result = errorResult(
      `the result of execute cannot be sent as JSON (${error}); return plain data: strings, numbers, booleans, arrays and objects without BigInt values or circular references`,
    );
    json = JSON.stringify(result);
  }
  if (maxBytes > 0 && Buffer.byteLength(json) > maxBytes) {
    json = JSON.stringify(cut(result, maxBytes));
  }
  return json;
}

/** Encode a progress content array, with the same limits as a result. */
function encodeProgressContent(content, maxBytes) {
  let { json, error } = toJson(content);
  if (error) {
    content = [{ type: 'text', text: `[progress update cannot be sent as JSON: ${error}]` }];
    json = JSON.stringify(content);
  }
  if (maxBytes > 0 && Buffer.byteLength(json) > maxBytes) {
    const r = cut({ status: 'ok', content, isError: false }, maxBytes);
    json = JSON.stringify(r.content);
  }
  return json;
}

module.exports = {
  BUN_MESSAGE,
  resolveExecute,
  thrownMessage,
  toolStack,
  isBun,
  loadFailure,
  notAToolResult,
  errorResult,
  fromReturn,
  progressContent,
  encodeResult,
  encodeProgressContent,
  cut,
};
