'use strict';
// Loads tool entries the way pi's tool loader does: index.ts or index.js,
// lazily, ES modules and CommonJS alike. Every .ts/.mts/.cts/.tsx file, and every
// .js/.mjs file inside a tool's folder, is transformed on its own by esbuild into
// CommonJS and compiled by Node's CommonJS loader under its real filename, so
// relative imports, node: builtins, __dirname, __filename and import.meta.url all
// work per file. Transforms are cached by (filename, content hash); a tool whose
// files changed on disk is dropped from require.cache before its next call.
// With SANDBOXD_TRANSPILE_CACHE (a folder the daemon fills with the global tools
// transpiled on the host, mounted read-only), a file found there by key is not
// transpiled here, and esbuild starts only on a miss (docs/performance.md).
const Module = require('node:module');
const fs = require('node:fs');
const path = require('node:path');
const crypto = require('node:crypto');
const { pathToFileURL } = require('node:url');
const { performance } = require('node:perf_hooks');

// The Node that runs the shim (images/node/runtime); sandboxd/tools/esbuild.py transpiles for the same one.
const NODE_TARGET = 'node24';
const TS_LOADERS = { '.ts': 'ts', '.mts': 'ts', '.cts': 'ts', '.tsx': 'tsx' };
const JS_ALTERNATIVES = { '.js': ['.ts', '.tsx'], '.jsx': ['.tsx'], '.mjs': ['.mts'], '.cjs': ['.cts'] };

const stats = { transpiles: 0, transpileCacheHits: 0, precompiledHits: 0, transpileMs: 0, loads: 0, reloads: 0,
  esbuildStarted: false };
const transpiled = new Map(); // filename -> { hash, code }
const sourceRoots = new Set(); // real paths of called tools' folders and the PI_TOOLS_DIRS roots
const signatures = new Map(); // filename -> stat signature at load time

let esbuild = null;
let warn = (msg) => process.stderr.write(`${msg}\n`);
let precompiledDir = null;
let esbuildVersion = null;

function getEsbuild() {
  if (!esbuild) {
    esbuild = require('esbuild');
    stats.esbuildStarted = true;
  }
  return esbuild;
}

/**
 * The name of a file's transpiled code in the daemon's cache: the esbuild version, the
 * loader, the file's path and its source decide the output (sandboxd/tools/transpile_cache.py
 * computes the same key).
 */
function precompiledKey(filename, source, loader) {
  if (esbuildVersion === null) {
    // Read, not required: loading esbuild's package would start nothing, but costs ~5 ms.
    esbuildVersion = JSON.parse(fs.readFileSync(require.resolve('esbuild/package.json'), 'utf8')).version;
  }
  return crypto
    .createHash('sha256')
    .update(`sandboxd-transpile-1\0${esbuildVersion}\0${loader}\0${filename}\0`)
    .update(source)
    .digest('hex');
}

function readPrecompiled(filename, source, loader) {
  if (precompiledDir === null) return null;
  try {
    return fs.readFileSync(path.join(precompiledDir, `${precompiledKey(filename, source, loader)}.js`), 'utf8');
  } catch {
    return null; // a miss: not a global tool, edited since, or the cache is still being filled
  }
}

/** Start esbuild's service ahead of the first TypeScript call. */
function prewarm() {
  getEsbuild().transformSync('export const x: number = 1', { loader: 'ts', format: 'cjs' });
}

/**
 * Make `entry`, the shim's own warm-up tool (main.js, warmUp), loadable by load() as a tool
 * is, without esbuild: its source is taken as its transpiled code. Also looks its key up in
 * the daemon's transpile cache (a miss, and the answer is dropped either way), so the first
 * real call finds hashing, esbuild's version and that read done. Returns what forgets the
 * tool afterwards: its module, its folder and the counters are as before.
 */
function warmUp(entry) {
  const dir = fs.realpathSync.native(path.dirname(entry));
  const filename = path.join(dir, path.basename(entry));
  const source = fs.readFileSync(filename, 'utf8');
  readPrecompiled(filename, source, 'ts');
  transpiled.set(filename, { hash: crypto.createHash('sha256').update(source).digest('base64'), code: source });
  const before = { ...stats };
  return function forget() {
    purge(dir);
    sourceRoots.delete(dir);
    transpiled.delete(filename);
    Object.assign(stats, before);
  };
}

class ToolLoadError extends Error {
  constructor(message, cause) {
    super(message);
    this.name = 'ToolLoadError';
    if (cause) this.cause = cause;
  }
}

function statSignature(filename) {
  try {
    const s = fs.statSync(filename, { bigint: true });
    return `${s.ino}:${s.size}:${s.mtimeNs}:${s.ctimeNs}`;
  } catch {
    return null;
  }
}

/** .js/.mjs files of a tool (not of its node_modules) go through esbuild. */
function isToolSource(filename) {
  for (const dir of sourceRoots) {
    if (filename.startsWith(dir + path.sep)) {
      return !filename.slice(dir.length).includes(`${path.sep}node_modules${path.sep}`);
    }
  }
  return false;
}

function addSourceRoot(dir) {
  try {
    sourceRoots.add(fs.realpathSync(dir));
  } catch {
    /* a root that does not exist (yet) holds no sources */
  }
}

function formatEsbuildError(filename, e) {
  const errors = Array.isArray(e && e.errors) ? e.errors : [];
  if (!errors.length) return `${filename}: ${e && e.message ? e.message : String(e)}`;
  return errors
    .slice(0, 5)
    .map((m) => {
      const loc = m.location ? `${m.location.file || filename}:${m.location.line}:${m.location.column + 1}: ` : `${filename}: `;
      let text = m.text;
      if (/top-level await/i.test(text)) {
        text += ' (tools are loaded as CommonJS, so top-level await is not supported: move the await into execute() or a function it calls)';
      }
      return loc + text;
    })
    .join('\n');
}

function transpile(filename, source, loader) {
  const hash = crypto.createHash('sha256').update(source).digest('base64');
  const hit = transpiled.get(filename);
  if (hit && hit.hash === hash) {
    stats.transpileCacheHits += 1;
    return hit.code;
  }
  const precompiled = readPrecompiled(filename, source, loader);
  if (precompiled !== null) {
    stats.precompiledHits += 1;
    transpiled.set(filename, { hash, code: precompiled });
    return precompiled;
  }
  const t0 = performance.now();
  let result;
  try {
    const url = JSON.stringify(pathToFileURL(filename).href);
    result = getEsbuild().transformSync(source, {
      loader,
      format: 'cjs',
      platform: 'node',
      target: NODE_TARGET,
      sourcemap: 'inline',
      sourcesContent: false,
      sourcefile: filename,
      // import() of a sibling .ts file must go through require() and these hooks.
      supported: { 'dynamic-import': false },
      define: {
        'import.meta.url': url,
        'import.meta.filename': JSON.stringify(filename),
        'import.meta.dirname': JSON.stringify(path.dirname(filename)),
      },
      logLevel: 'silent',
    });
  } catch (e) {
    throw new ToolLoadError(`cannot compile ${formatEsbuildError(filename, e)}`, e);
  }
  stats.transpiles += 1;
  stats.transpileMs += performance.now() - t0;
  for (const w of result.warnings || []) {
    warn(`esbuild warning: ${formatEsbuildError(filename, { errors: [w] })}`);
  }
  transpiled.set(filename, { hash, code: result.code });
  return result.code;
}

function compileWith(loader) {
  return function compile(module, filename) {
    signatures.set(filename, statSignature(filename));
    let source = fs.readFileSync(filename, 'utf8');
    if (source.charCodeAt(0) === 0xfeff) source = source.slice(1);
    module._compile(transpile(filename, source, loader), filename);
  };
}

let installed = false;

function install(options = {}) {
  if (installed) return;
  installed = true;
  if (options.warn) warn = options.warn;
  if (options.precompiledDir && path.isAbsolute(options.precompiledDir)) precompiledDir = options.precompiledDir;
  for (const dir of (options.toolsDirs || '').split(':')) {
    if (dir && path.isAbsolute(dir)) addSourceRoot(dir);
  }

  for (const [ext, loader] of Object.entries(TS_LOADERS)) {
    Module._extensions[ext] = compileWith(loader);
  }
  const origJs = Module._extensions['.js'];
  const compileJs = compileWith('js');
  Module._extensions['.js'] = function js(module, filename) {
    if (isToolSource(filename)) return compileJs(module, filename);
    return origJs.call(this, module, filename);
  };
  const origMjs = Module._extensions['.mjs'];
  Module._extensions['.mjs'] = function mjs(module, filename) {
    if (isToolSource(filename) || !origMjs) return compileJs(module, filename);
    return origMjs.call(this, module, filename);
  };

  // TypeScript written for Node's ESM resolution imports './util.js' while the
  // file on disk is util.ts: try the TypeScript twin when the .js is missing.
  const origResolve = Module._resolveFilename;
  Module._resolveFilename = function resolveFilename(request, parent, isMain, opts) {
    try {
      return origResolve.call(this, request, parent, isMain, opts);
    } catch (e) {
      if (e && e.code === 'MODULE_NOT_FOUND' && /^\.\.?[/\\]/.test(request)) {
        const ext = path.extname(request);
        for (const alt of JS_ALTERNATIVES[ext] || []) {
          try {
            return origResolve.call(this, request.slice(0, -ext.length) + alt, parent, isMain, opts);
          } catch {
            /* try the next one */
          }
        }
      }
      throw e;
    }
  };
}

/** Drop every cached module of a tool folder (and Node's resolution cache for it). */
function purge(dir) {
  const prefix = dir + path.sep;
  const cache = Module._cache;
  for (const filename of Object.keys(cache)) {
    if (!filename.startsWith(prefix)) continue;
    const mod = cache[filename];
    delete cache[filename];
    signatures.delete(filename);
    const parent = mod && mod.parent;
    if (parent && Array.isArray(parent.children)) {
      const i = parent.children.indexOf(mod);
      if (i !== -1) parent.children.splice(i, 1);
    }
  }
  const pathCache = Module._pathCache;
  if (pathCache) {
    for (const key of Object.keys(pathCache)) {
      if (typeof pathCache[key] === 'string' && pathCache[key].startsWith(prefix)) delete pathCache[key];
    }
  }
}

/** Returns the first file of the tool folder that changed since it was loaded, or null. */
function changedFile(dir) {
  const prefix = dir + path.sep;
  for (const filename of Object.keys(Module._cache)) {
    if (!filename.startsWith(prefix)) continue;
    const now = statSignature(filename);
    if (!signatures.has(filename)) {
      signatures.set(filename, now);
      continue;
    }
    if (signatures.get(filename) !== now) return filename;
  }
  return null;
}

/**
 * Load (or reuse) a tool entry. A changed file anywhere in the tool's folder
 * reloads the whole folder; a load failure leaves nothing of it cached.
 * @returns {{ mod: any, filename: string }}
 */
function load(entry) {
  if (typeof entry !== 'string' || !path.isAbsolute(entry)) {
    throw new ToolLoadError(`entry must be an absolute path, got ${JSON.stringify(entry)}`);
  }
  let dir;
  try {
    // .native: one realpath(3) per call instead of an lstat per path component.
    dir = fs.realpathSync.native(path.dirname(entry));
  } catch {
    throw new ToolLoadError(`tool folder not found: ${path.dirname(entry)}`);
  }
  const filename = path.join(dir, path.basename(entry));
  if (!fs.existsSync(filename)) throw new ToolLoadError(`entry file not found: ${entry}`);
  sourceRoots.add(dir);

  const changed = changedFile(dir);
  if (changed) {
    warn(`${changed} changed on disk: reloading ${dir}`);
    purge(dir);
    stats.reloads += 1;
  }
  const fresh = !Module._cache[filename];
  let mod;
  try {
    mod = require(filename);
  } catch (e) {
    purge(dir);
    throw e;
  }
  if (fresh) {
    stats.loads += 1;
    // Record files loaded without our hooks (JSON, .cjs, node_modules) too. A cached
    // entry loaded nothing new: the stats before the call were the only ones needed.
    changedFile(dir);
  }
  return { mod, filename };
}

module.exports = { install, load, prewarm, warmUp, stats, ToolLoadError, NODE_TARGET };
