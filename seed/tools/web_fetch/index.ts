import { existsSync, realpathSync, writeFileSync } from 'node:fs';
import { basename, dirname, join, resolve } from 'node:path';

type ToolResult = { content: Array<{ type: string; text: string }>; isError?: boolean };
type OnUpdate = (partial: { content: Array<{ type: string; text: string }> }) => void;
type Params = { url: string; max_chars?: number; output_path?: string; timeout_seconds?: number };

const DEFAULT_MAX_CHARS = 20_000;
const MAX_MAX_CHARS = 500_000;
// What is read of a body (after decompression): a page that never ends, or a
// compressed bomb, must not take the sandbox's memory or the call's time.
const MAX_BYTES = 5 * 1024 * 1024;
const MAX_REDIRECTS = 10;
const PREVIEW_CHARS = 1_000;
const USER_AGENT = 'Mozilla/5.0 (compatible; sandboxd-web_fetch/1)';

function ok(text: string): ToolResult {
  return { content: [{ type: 'text', text }] };
}

function err(text: string): ToolResult {
  return { content: [{ type: 'text', text }], isError: true };
}


// --- the user's folder, and paths confined to it: the same in every seed tool that takes paths
// (each tool folder stands alone, as TOOLS.md asks); tests/unit/test_seed_tools.py keeps the copies equal.
function userRoot(): string {
  return process.env.OFFICER_USER_ROOT || '/officer/user';
}

function userPath(param: string, value: string, mustExist: boolean): string {
  const root = userRoot();
  const fix = `Fix: use a path inside ${root}, e.g. ${root}/result.json`;
  const inside = (p: string) => p === root || p.startsWith(root + '/');
  const abs = resolve(root, value);
  if (!inside(abs)) throw new Error(`${param} must be inside ${root}, got ${value}. ${fix}`);
  if (mustExist && !existsSync(abs)) throw new Error(`${param}: no such file: ${abs}. Fix: check the path (list ${root} to see what is there).`);
  if (!existsSync(dirname(abs))) throw new Error(`${param}: the folder ${dirname(abs)} does not exist. Fix: write into an existing folder such as ${root}.`);
  const real = existsSync(abs) ? realpathSync(abs) : join(realpathSync(dirname(abs)), basename(abs));
  if (!inside(real)) throw new Error(`${param} must be inside ${root}, got ${value}, which resolves to ${real} through a link. ${fix}`);
  return real;
}
// --- end of the user's folder

function wholeNumber(param: string, value: unknown, fallback: number, min: number, max: number): number {
  if (value === undefined || value === null) return fallback;
  if (typeof value !== 'number' || !Number.isInteger(value) || value < min || value > max) {
    throw new Error(`${param} must be a whole number from ${min} to ${max}, got ${JSON.stringify(value)}.`);
  }
  return value;
}

function size(bytes: number): string {
  return bytes >= 1024 * 1024 ? `${(bytes / 1024 / 1024).toFixed(1)} MiB` : bytes >= 1024 ? `${(bytes / 1024).toFixed(1)} KiB` : `${bytes} bytes`;
}

// ---- fetching ---------------------------------------------------------------

class FetchProblem extends Error {}

// The messages along an error's cause chain, outermost first: undici says "fetch failed"
// and puts the reason (ECONNREFUSED, the egress proxy's refusal) in the causes.
function causes(e: unknown): string[] {
  const out: string[] = [];
  for (let cur = e, depth = 0; cur && depth < 6; depth += 1) {
    const message = cur instanceof Error ? cur.message : String(cur);
    const code = (cur as { code?: unknown }).code;
    // ECONNREFUSED says more than "connect failed"; the shim's EGRESS_* codes say nothing its message does not.
    out.push(typeof code === 'string' && !message.includes(code) && !code.startsWith('EGRESS_') ? `${message} (${code})` : message);
    cur = cur instanceof Error ? cur.cause : undefined;
  }
  return out;
}

// The same, each said once: a wrapper often repeats its cause's message in its own.
function reasons(e: unknown): string[] {
  const out: string[] = [];
  for (const text of causes(e)) if (text && !out.some((seen) => seen.includes(text))) out.push(text);
  return out;
}

// What sandboxd's egress proxy said (refused by its policy, or failed: the name does not
// resolve, say): the innermost such message is its own line, without "fetch failed: " before it.
function egressLine(e: unknown): string | undefined {
  return causes(e).reverse().find((r) => r.includes("sandboxd's egress policy") || r.startsWith('egress to '));
}

async function readCapped(res: Response, cap: number): Promise<{ bytes: Buffer; truncated: boolean }> {
  if (!res.body) return { bytes: Buffer.alloc(0), truncated: false };
  const reader = res.body.getReader();
  const chunks: Uint8Array[] = [];
  let total = 0;
  let truncated = false;
  for (;;) {
    const { done, value } = await reader.read();
    if (done) break;
    const room = cap - total;
    if (value.byteLength > room) {
      chunks.push(value.subarray(0, room));
      total += room;
      truncated = true;
      break;
    }
    chunks.push(value);
    total += value.byteLength;
  }
  if (truncated) await reader.cancel().catch(() => undefined);
  return { bytes: Buffer.concat(chunks, total), truncated };
}

type Fetched = { res: Response; url: URL; chain: string[] };

// Redirects are followed here, not by fetch, so the hops are counted and named in the answer
// and a hop to another scheme is refused; each is a new request the egress proxy checks again.
async function fetchFollowing(start: URL, signal: AbortSignal): Promise<Fetched> {
  let url = start;
  const chain: string[] = [];
  for (;;) {
    const res = await fetch(url, {
      redirect: 'manual',
      signal,
      headers: {
        'user-agent': USER_AGENT,
        accept: 'text/html,application/xhtml+xml,text/plain;q=0.9,application/json;q=0.9,*/*;q=0.8',
        'accept-language': 'en;q=1, *;q=0.5',
      },
    });
    const location = res.headers.get('location');
    if (![301, 302, 303, 307, 308].includes(res.status) || !location) return { res, url, chain };
    await res.body?.cancel().catch(() => undefined);
    chain.push(url.href);
    if (chain.length > MAX_REDIRECTS) {
      throw new FetchProblem(`${start.href} redirected more than ${MAX_REDIRECTS} times (last to ${location}); giving up.`);
    }
    let next: URL;
    try {
      next = new URL(location, url);
    } catch {
      throw new FetchProblem(`${url.href} redirected to ${JSON.stringify(location)}, which is not a URL.`);
    }
    if (next.protocol !== 'http:' && next.protocol !== 'https:') {
      throw new FetchProblem(`${url.href} redirected to ${next.href}; web_fetch follows http and https only.`);
    }
    url = next;
  }
}

// ---- decoding ---------------------------------------------------------------

function contentType(res: Response): { mime: string; charset?: string } {
  const header = res.headers.get('content-type') ?? '';
  const mime = header.split(';')[0].trim().toLowerCase();
  const charset = /;\s*charset\s*=\s*"?([\w.:-]+)/i.exec(header)?.[1];
  return { mime, charset };
}

function looksLikeHtml(bytes: Buffer): boolean {
  return /^\s*(<!--[\s\S]*?-->\s*)*<(!doctype\s+html|html|head|body|title)\b/i.test(bytes.subarray(0, 1024).toString('latin1'));
}

const TEXT_TYPES = /^(text\/.+|application\/(json|xml|javascript|ecmascript|x-javascript|x-sh|x-yaml|yaml|toml|sql|graphql|csv|x-ndjson|ndjson|x-www-form-urlencoded)|.+\+(json|xml))$/;

function looksLikeText(bytes: Buffer): boolean {
  const head = bytes.subarray(0, 8192);
  if (head.includes(0)) return false;
  try {
    new TextDecoder('utf-8', { fatal: true }).decode(head, { stream: true });
    return true;
  } catch {
    return false;
  }
}

function decode(bytes: Buffer, charset: string | undefined, html: boolean): string {
  let label = charset;
  if (bytes[0] === 0xff && bytes[1] === 0xfe) label = 'utf-16le';
  else if (bytes[0] === 0xfe && bytes[1] === 0xff) label = 'utf-16be';
  else if (!label && html) {
    const head = bytes.subarray(0, 4096).toString('latin1');
    label = /<meta[^>]{0,300}?charset\s*=\s*["']?\s*([\w.:-]+)/i.exec(head)?.[1];
  }
  try {
    return new TextDecoder(label || 'utf-8').decode(bytes);
  } catch {
    return new TextDecoder('utf-8').decode(bytes); // a label TextDecoder does not know
  }
}

// ---- HTML to text -------------------------------------------------------------

const NAMED: Record<string, string> = {
  amp: '&', lt: '<', gt: '>', quot: '"', apos: "'", nbsp: '\u00a0', shy: '', copy: '©', reg: '®', trade: '™',
  hellip: '…', mdash: '—', ndash: '–', minus: '−', lsquo: '‘', rsquo: '’', sbquo: '‚', ldquo: '“', rdquo: '”',
  bdquo: '„', laquo: '«', raquo: '»', lsaquo: '‹', rsaquo: '›', bull: '•', middot: '·', prime: '′', Prime: '″',
  dagger: '†', Dagger: '‡', permil: '‰', euro: '€', pound: '£', yen: '¥', cent: '¢', curren: '¤', deg: '°',
  times: '×', divide: '÷', plusmn: '±', para: '¶', sect: '§', micro: 'µ', ordf: 'ª', ordm: 'º', sup1: '¹',
  sup2: '²', sup3: '³', frac14: '¼', frac12: '½', frac34: '¾', iexcl: '¡', iquest: '¿', not: '¬', macr: '¯',
  acute: '´', cedil: '¸', uml: '¨', brvbar: '¦', larr: '←', rarr: '→', uarr: '↑', darr: '↓', harr: '↔',
  rArr: '⇒', lArr: '⇐', hArr: '⇔', le: '≤', ge: '≥', ne: '≠', asymp: '≈', equiv: '≡', infin: '∞', sum: '∑',
  prod: '∏', radic: '√', part: '∂', int: '∫', isin: '∈', notin: '∉', cap: '∩', cup: '∪', and: '∧', or: '∨',
  forall: '∀', exist: '∃', empty: '∅', nabla: '∇', lowast: '∗', sdot: '⋅', loz: '◊', spades: '♠', clubs: '♣',
  hearts: '♥', diams: '♦', ensp: '\u2002', emsp: '\u2003', thinsp: '\u2009', zwnj: '\u200c', zwj: '\u200d',
  lrm: '\u200e', rlm: '\u200f', check: '✓', star: '☆', starf: '★', tilde: '˜', circ: 'ˆ', fnof: 'ƒ',
  Agrave: 'À', Aacute: 'Á', Acirc: 'Â', Atilde: 'Ã', Auml: 'Ä', Aring: 'Å', AElig: 'Æ', Ccedil: 'Ç',
  Egrave: 'È', Eacute: 'É', Ecirc: 'Ê', Euml: 'Ë', Igrave: 'Ì', Iacute: 'Í', Icirc: 'Î', Iuml: 'Ï', ETH: 'Ð',
  Ntilde: 'Ñ', Ograve: 'Ò', Oacute: 'Ó', Ocirc: 'Ô', Otilde: 'Õ', Ouml: 'Ö', Oslash: 'Ø', Ugrave: 'Ù',
  Uacute: 'Ú', Ucirc: 'Û', Uuml: 'Ü', Yacute: 'Ý', THORN: 'Þ', szlig: 'ß', agrave: 'à', aacute: 'á',
  acirc: 'â', atilde: 'ã', auml: 'ä', aring: 'å', aelig: 'æ', ccedil: 'ç', egrave: 'è', eacute: 'é',
  ecirc: 'ê', euml: 'ë', igrave: 'ì', iacute: 'í', icirc: 'î', iuml: 'ï', eth: 'ð', ntilde: 'ñ', ograve: 'ò',
  oacute: 'ó', ocirc: 'ô', otilde: 'õ', ouml: 'ö', oslash: 'ø', ugrave: 'ù', uacute: 'ú', ucirc: 'û',
  uuml: 'ü', yacute: 'ý', thorn: 'þ', yuml: 'ÿ', OElig: 'Œ', oelig: 'œ', Scaron: 'Š', scaron: 'š', Yuml: 'Ÿ',
  Alpha: 'Α', Beta: 'Β', Gamma: 'Γ', Delta: 'Δ', Omega: 'Ω', alpha: 'α', beta: 'β', gamma: 'γ', delta: 'δ',
  epsilon: 'ε', lambda: 'λ', mu: 'μ', pi: 'π', sigma: 'σ', tau: 'τ', phi: 'φ', omega: 'ω', theta: 'θ',
};
// Numeric references 128-159 mean windows-1252 characters (the HTML standard says so).
const C1 = '€\u0081‚ƒ„…†‡ˆ‰Š‹Œ\u008dŽ\u008f\u0090‘’“”•–—˜™š›œ\u009džŸ';
// Without a ";" only these are decoded, and not before "=" or an alphanumeric (a query string's &copy=1).
const BARE = new Set(['amp', 'lt', 'gt', 'quot', 'nbsp']);

function decodeEntities(s: string): string {
  if (!s.includes('&')) return s;
  return s.replace(/&(?:#(\d{1,8})|#[xX]([0-9a-fA-F]{1,8})|([a-zA-Z][a-zA-Z0-9]{0,31}))(;?)/g,
    (whole, dec: string | undefined, hex: string | undefined, name: string | undefined, semi: string, at: number) => {
      if (name !== undefined) {
        if (!(name in NAMED)) return whole;
        if (!semi && (!BARE.has(name) || /[=a-zA-Z0-9]/.test(s[at + whole.length] ?? ''))) return whole;
        return NAMED[name];
      }
      const code = dec !== undefined ? parseInt(dec, 10) : parseInt(hex!, 16);
      if (code >= 128 && code <= 159) return C1[code - 128];
      if (code === 0 || code > 0x10ffff || (code >= 0xd800 && code <= 0xdfff)) return '\ufffd';
      return String.fromCodePoint(code);
    });
}

// Elements whose content is dropped whole (scripts, styles, drawings, embedded
// documents, option lists); title is kept aside as the page's title.
const DROPPED = new Set(['script', 'style', 'noscript', 'svg', 'math', 'template', 'iframe', 'object', 'canvas', 'select', 'title']);
const PARAGRAPH = new Set(['p', 'blockquote', 'pre', 'table', 'ul', 'ol', 'dl', 'figure', 'form', 'fieldset', 'address', 'details', 'hr', 'h1', 'h2', 'h3', 'h4', 'h5', 'h6']);
const LINE = new Set(['br', 'div', 'section', 'article', 'main', 'header', 'footer', 'nav', 'aside', 'li', 'dt', 'dd', 'tr', 'thead', 'tbody', 'tfoot', 'caption', 'figcaption', 'summary', 'legend', 'center', 'option', 'body', 'html', 'label']);
const ATTRIBUTE = /([^\s"'=<>/]+)(?:\s*=\s*(?:"([^"]*)"|'([^']*)'|([^\s"'=<>`]+)))?/g;
// The tag at one position (sticky): attributes may not hold "<", so a failed attempt stops at the next one.
const TAG = /<(\/?)([a-zA-Z][a-zA-Z0-9:-]*)((?:[^<>"']|"[^"<]*"|'[^'<]*')*)>/y;

function attributes(raw: string): Map<string, string> {
  const found = new Map<string, string>();
  for (const m of raw.matchAll(ATTRIBUTE)) {
    const name = m[1].toLowerCase();
    if (!found.has(name)) found.set(name, decodeEntities(m[2] ?? m[3] ?? m[4] ?? ''));
  }
  return found;
}

// The text being built: runs of white space become one space, block edges become
// line breaks, and no line ends in spaces.
class Out {
  private parts: string[] = [];
  private newlines = 2;
  private space = true;

  text(s: string): void {
    if (this.space && s.startsWith(' ')) s = s.slice(1);
    if (!s) return;
    this.parts.push(s);
    this.newlines = 0;
    this.space = s.endsWith(' ');
  }

  verbatim(s: string): void {
    if (!s) return;
    this.parts.push(s);
    const trailing = /\n*$/.exec(s)![0].length;
    this.newlines = trailing === s.length ? this.newlines + trailing : trailing;
    this.space = /\s$/.test(s);
  }

  breaks(n: number): void {
    if (this.space && this.newlines === 0 && this.parts.length) {
      const last = this.parts.pop()!.replace(/ +$/, '');
      if (last) this.parts.push(last);
    }
    for (; this.newlines < n; this.newlines += 1) this.parts.push('\n');
    this.space = true;
  }

  mark(): number {
    return this.parts.length;
  }

  since(mark: number): string {
    return this.parts.slice(mark).join('');
  }

  done(): string {
    return this.parts.join('').replace(/\u00a0/g, ' ').replace(/[ \t]+\n/g, '\n').replace(/\n{3,}/g, '\n\n').trim();
  }
}

function linkTarget(href: string, base: URL): string | undefined {
  let url: URL;
  try {
    url = new URL(href.trim(), base);
  } catch {
    return undefined;
  }
  if (url.protocol !== 'http:' && url.protocol !== 'https:' && url.protocol !== 'mailto:') return undefined;
  // A jump within the page says nothing the text does not.
  if (url.hash && url.href.slice(0, -url.hash.length) === base.href.split('#')[0]) return undefined;
  return url.href;
}

function htmlToText(html: string, pageUrl: URL): { title: string; text: string } {
  const out = new Out();
  let base = pageUrl;
  let title = '';
  let pre = 0;
  const lists: Array<{ ordered: boolean; n: number }> = [];
  let link: { href?: string; mark: number } | undefined;
  let cells = 0;
  let pos = 0;

  const closeLink = () => {
    if (!link) return;
    const inner = out.since(link.mark).trim();
    if (link.href && inner && inner !== link.href) out.text(` [${link.href}]`);
    link = undefined;
  };
  const addText = (raw: string) => {
    if (!raw) return;
    if (pre) out.verbatim(decodeEntities(raw));
    else out.text(decodeEntities(raw).replace(/[ \t\n\r\f]+/g, ' '));
  };

  while (pos < html.length) {
    const lt = html.indexOf('<', pos);
    if (lt === -1) {
      addText(html.slice(pos));
      break;
    }
    addText(html.slice(pos, lt));
    pos = lt;
    if (html.startsWith('<!--', pos)) {
      const end = html.indexOf('-->', pos + 4);
      pos = end === -1 ? html.length : end + 3;
      continue;
    }
    if (html[pos + 1] === '!' || html[pos + 1] === '?') {
      const end = html.indexOf('>', pos);
      pos = end === -1 ? html.length : end + 1;
      continue;
    }
    TAG.lastIndex = pos;
    const m = TAG.exec(html);
    if (!m) {
      addText('<');
      pos += 1;
      continue;
    }
    pos = TAG.lastIndex;
    const closing = m[1] === '/';
    const name = m[2].toLowerCase();
    const selfClosing = m[3].trimEnd().endsWith('/');

    if (!closing && DROPPED.has(name)) {
      if (selfClosing) continue;
      const end = new RegExp(`</${name}[\\s/>]`, 'gi');
      end.lastIndex = pos;
      const close = end.exec(html);
      const stop = close ? close.index : html.length;
      if (name === 'title' && !title) title = decodeEntities(html.slice(pos, stop)).replace(/\s+/g, ' ').trim();
      const gt = close ? html.indexOf('>', stop) : -1;
      pos = gt === -1 ? html.length : gt + 1;
      continue;
    }
    if (name === 'base' && !closing) {
      const href = attributes(m[3]).get('href');
      try {
        if (href) base = new URL(href, pageUrl);
      } catch {
        /* a base that is not a URL is ignored, as browsers do */
      }
      continue;
    }
    if (name === 'a') {
      closeLink(); // an <a> inside an unclosed <a> ends it, as browsers do
      if (!closing) {
        const href = attributes(m[3]).get('href');
        link = { href: href === undefined ? undefined : linkTarget(href, base), mark: out.mark() };
      }
      continue;
    }
    if (name === 'pre') pre = Math.max(0, pre + (closing ? -1 : 1));
    if ((name === 'ul' || name === 'ol') && !closing) lists.push({ ordered: name === 'ol', n: 0 });
    if ((name === 'ul' || name === 'ol') && closing) lists.pop();
    if (name === 'tr') cells = 0;

    if (/^h[1-6]$/.test(name)) {
      out.breaks(2);
      if (!closing) out.text('#'.repeat(Number(name[1])) + ' ');
    } else if (name === 'li' && !closing) {
      out.breaks(1);
      const list = lists[lists.length - 1];
      const indent = '  '.repeat(Math.max(0, lists.length - 1));
      if (list) list.n += 1;
      out.verbatim(indent + (list?.ordered ? `${list.n}. ` : '- '));
    } else if ((name === 'td' || name === 'th') && !closing) {
      if (cells > 0) out.text(' | ');
      cells += 1;
    } else if (name === 'hr') {
      out.breaks(2);
      out.text('---');
      out.breaks(2);
    } else if ((name === 'ul' || name === 'ol') && lists.length > (closing ? 0 : 1)) {
      out.breaks(1); // a list inside a list item
    } else if (PARAGRAPH.has(name)) {
      out.breaks(2);
    } else if (LINE.has(name)) {
      out.breaks(1);
    }
  }
  closeLink();
  return { title, text: out.done() };
}

// ---- the tool -----------------------------------------------------------------

export async function execute(
  _toolCallId: string,
  params: Params,
  signal?: AbortSignal,
  onUpdate?: OnUpdate,
): Promise<ToolResult> {
  try {
    return await fetchPage(params, signal, onUpdate);
  } catch (e) {
    return err(`web_fetch failed: ${e instanceof Error ? e.message : String(e)}`);
  }
}

async function fetchPage(params: Params, signal?: AbortSignal, onUpdate?: OnUpdate): Promise<ToolResult> {
  let start: URL;
  let maxChars: number;
  let timeoutS: number;
  let out: string | undefined;
  try {
    if (typeof params.url !== 'string' || !params.url.trim()) return err('url is required: the http:// or https:// address of the page to fetch.');
    try {
      start = new URL(params.url.trim());
    } catch {
      return err(`url ${JSON.stringify(params.url)} is not a URL. Fix: pass a full address such as https://example.com/page.`);
    }
    if (start.protocol !== 'http:' && start.protocol !== 'https:') {
      return err(`url must be http:// or https://, got ${start.protocol}//… (${params.url}). web_fetch fetches web pages only.`);
    }
    maxChars = wholeNumber('max_chars', params.max_chars, DEFAULT_MAX_CHARS, 1, MAX_MAX_CHARS);
    timeoutS = wholeNumber('timeout_seconds', params.timeout_seconds, 30, 1, 300);
    out = params.output_path ? userPath('output_path', params.output_path, false) : undefined;
  } catch (e) {
    return err(e instanceof Error ? e.message : String(e));
  }

  const timeout = AbortSignal.timeout(timeoutS * 1000);
  const both = signal ? AbortSignal.any([signal, timeout]) : timeout;
  let fetched: Fetched;
  let body: { bytes: Buffer; truncated: boolean };
  try {
    onUpdate?.({ content: [{ type: 'text', text: `Fetching ${start.href}…` }] });
    fetched = await fetchFollowing(start, both);
    body = await readCapped(fetched.res, MAX_BYTES);
  } catch (e) {
    if (signal?.aborted) return err(`web_fetch of ${start.href} was cancelled.`);
    if (timeout.aborted) return err(`web_fetch of ${start.href} timed out after ${timeoutS} s. Fix: try again, or pass a larger timeout_seconds (up to 300).`);
    if (e instanceof FetchProblem) return err(e.message);
    const said = egressLine(e);
    if (said) return err(`Could not fetch ${start.href}: ${said}`);
    return err(`Could not fetch ${start.href}: ${reasons(e).join(': ')}.`);
  }

  const { res, url, chain } = fetched;
  // sandboxd's egress proxy answers a refused or failed plain-http request itself.
  const egress = res.headers.get('x-sandboxd-egress');
  if (egress === 'refused' || egress === 'failed') {
    const line = body.bytes.toString('utf-8').trim().split('\n')[0];
    return err(`Could not fetch ${url.href}: ${line || `sandboxd's egress proxy answered HTTP ${res.status}`}`);
  }

  const { mime, charset } = contentType(res);
  const unknown = mime === '' || mime === 'application/octet-stream';
  const html = mime === 'text/html' || mime === 'application/xhtml+xml' || (unknown && looksLikeHtml(body.bytes));
  const textual = html || TEXT_TYPES.test(mime) || (unknown && looksLikeText(body.bytes));
  const page = html ? htmlToText(decode(body.bytes, charset, true), url) : undefined;
  const text = page ? page.text : textual ? decode(body.bytes, charset, false).replace(/\r\n/g, '\n').trim() : '';

  if (res.status >= 400) {
    const excerpt = text.replace(/\s+/g, ' ').trim().slice(0, 300);
    return err(`HTTP ${res.status}${res.statusText ? ' ' + res.statusText : ''} from ${url.href}${excerpt ? `: ${excerpt}` : ' (no readable body)'}`);
  }

  const header = [
    ...(page?.title ? [`Title: ${page.title}`] : []),
    `URL: ${url.href}`,
    ...(chain.length ? [`Redirected from: ${chain.join(' → ')}`] : []),
    ...(!html ? [`Content-Type: ${mime || 'not given'}`] : []),
  ].join('\n');
  const capNote = body.truncated ? `[web_fetch stopped reading after ${size(MAX_BYTES)}: the response is larger; what follows is its beginning only.]` : '';

  if (!textual) {
    const what = `Binary content (${mime || 'type not given'}), ${body.truncated ? `more than ${size(MAX_BYTES)}` : `${body.bytes.length} bytes`}: not shown as text.`;
    if (!out) return ok(`${header}\n\n${what} Pass output_path to save the file.`);
    if (body.truncated) return err(`${header}\n\n${what} It is larger than the ${size(MAX_BYTES)} web_fetch reads, so it was not saved to ${out}.`);
    writeFileSync(out, body.bytes);
    return ok(`${header}\n\n${what} Saved the ${body.bytes.length} bytes to ${out}.`);
  }

  const document = `${header}\n\n${capNote ? capNote + '\n\n' : ''}${text}\n`;
  if (out) {
    writeFileSync(out, document);
    const lines = text ? text.split('\n').length : 0;
    const preview = text.slice(0, Math.min(PREVIEW_CHARS, maxChars));
    return ok(`${header}\n\nSaved ${text.length} characters (${lines} lines) of text to ${out}.${capNote ? ' ' + capNote : ''}\n\n` +
      `Beginning:\n${preview}${text.length > preview.length ? '\n…' : ''}`);
  }
  if (!text) return ok(`${header}\n\n${capNote ? capNote + '\n\n' : ''}(the page has no text)`);
  const cut = text.length > maxChars
    ? `\n\n[cut at ${maxChars} of ${text.length} characters: pass output_path to save the whole text to a file, or a larger max_chars.]`
    : '';
  return ok(`${header}\n\n${capNote ? capNote + '\n\n' : ''}${text.slice(0, maxChars)}${cut}`);
}
