type ToolResult = { content: Array<{ type: string; text: string }>; isError?: boolean };
type OnUpdate = (partial: { content: Array<{ type: string; text: string }> }) => void;
type Params = { query: string; max_results?: number };

type SearxResult = { url?: unknown; title?: unknown; content?: unknown; publishedDate?: unknown; engine?: unknown };
type SearxAnswer = {
  results?: unknown;
  answers?: unknown;
  suggestions?: unknown;
  corrections?: unknown;
  number_of_results?: unknown;
  unresponsive_engines?: unknown;
};

const DEFAULT_RESULTS = 10;
const MAX_RESULTS = 50;
const TIMEOUT_S = 20;
// SearXNG's JSON for one page is tens of KiB; a server that sends more is not one.
const MAX_BYTES = 4 * 1024 * 1024;
const SNIPPET_CHARS = 400;

function ok(text: string): ToolResult {
  return { content: [{ type: 'text', text }] };
}

function err(text: string): ToolResult {
  return { content: [{ type: 'text', text }], isError: true };
}

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

async function readCapped(res: Response, cap: number): Promise<{ text: string; truncated: boolean }> {
  if (!res.body) return { text: '', truncated: false };
  const reader = res.body.getReader();
  const chunks: Uint8Array[] = [];
  let total = 0;
  for (;;) {
    const { done, value } = await reader.read();
    if (done) return { text: Buffer.concat(chunks, total).toString('utf-8'), truncated: false };
    chunks.push(value);
    total += value.byteLength;
    if (total > cap) {
      await reader.cancel().catch(() => undefined);
      return { text: Buffer.concat(chunks, total).toString('utf-8'), truncated: true };
    }
  }
}

function clean(value: unknown): string {
  return typeof value === 'string' ? value.replace(/<[^>]{0,200}>/g, '').replace(/\s+/g, ' ').trim() : '';
}

function excerpt(text: string): string {
  const line = text.replace(/\s+/g, ' ').trim();
  return line.length > 200 ? `${line.slice(0, 200)}…` : line;
}

function searxngBase(): URL | string {
  const raw = process.env.PI_SEARXNG_URL?.trim();
  if (!raw) {
    return 'Web search is not configured: PI_SEARXNG_URL is not set. It holds the address of the SearXNG instance ' +
      '(e.g. http://searxng:8080) and is passed by the operator (pi-bridge) with each call; sandboxd lets it through ' +
      '(calls.allowed_env has PI_SEARXNG_URL). Tell the user that web search needs a SearXNG instance configured; ' +
      'web_fetch still works for a known URL.';
  }
  let base: URL;
  try {
    base = new URL(raw);
  } catch {
    return `PI_SEARXNG_URL is not a URL: ${JSON.stringify(raw)}. It must be the SearXNG base address, e.g. http://searxng:8080; tell the user (the operator sets it).`;
  }
  if (base.protocol !== 'http:' && base.protocol !== 'https:') {
    return `PI_SEARXNG_URL must be an http:// or https:// address, got ${JSON.stringify(raw)}; tell the user (the operator sets it).`;
  }
  return base;
}

export async function execute(
  _toolCallId: string,
  params: Params,
  signal?: AbortSignal,
  onUpdate?: OnUpdate,
): Promise<ToolResult> {
  try {
    return await search(params, signal, onUpdate);
  } catch (e) {
    return err(`web_search failed: ${e instanceof Error ? e.message : String(e)}`);
  }
}

async function search(params: Params, signal?: AbortSignal, onUpdate?: OnUpdate): Promise<ToolResult> {
  const query = typeof params.query === 'string' ? params.query.trim() : '';
  if (!query) return err('query is required: the words to search the web for, e.g. "node.js undici proxy agent".');
  const asked = params.max_results ?? DEFAULT_RESULTS;
  if (typeof asked !== 'number' || !Number.isInteger(asked) || asked < 1) {
    return err(`max_results must be a whole number from 1 to ${MAX_RESULTS}, got ${JSON.stringify(params.max_results)}.`);
  }
  const wanted = Math.min(asked, MAX_RESULTS);
  const base = searxngBase();
  if (typeof base === 'string') return err(base);

  const endpoint = new URL(base.href.replace(/\/+$/, '') + '/search');
  endpoint.searchParams.set('q', query);
  endpoint.searchParams.set('format', 'json');
  const where = `SearXNG at ${base.origin}${base.pathname.replace(/\/+$/, '')} (PI_SEARXNG_URL)`;

  const timeout = AbortSignal.timeout(TIMEOUT_S * 1000);
  const both = signal ? AbortSignal.any([signal, timeout]) : timeout;
  let res: Response;
  let body: { text: string; truncated: boolean };
  try {
    onUpdate?.({ content: [{ type: 'text', text: `Searching for ${JSON.stringify(query)}…` }] });
    res = await fetch(endpoint, { signal: both, headers: { accept: 'application/json' } });
    body = await readCapped(res, MAX_BYTES);
  } catch (e) {
    if (signal?.aborted) return err('web_search was cancelled.');
    if (timeout.aborted) return err(`${where} did not answer within ${TIMEOUT_S} s; try again later or tell the user search is slow.`);
    const said = egressLine(e);
    if (said?.includes("sandboxd's egress policy")) {
      return err(`Could not reach ${where}: ${said}. The operator must allow SearXNG's host and port in egress.allow.`);
    }
    if (said) return err(`Could not reach ${where}: ${said}. Check that SearXNG runs and PI_SEARXNG_URL points at it.`);
    return err(`Could not reach ${where}: ${reasons(e).join(': ')}. Check that SearXNG runs and PI_SEARXNG_URL points at it.`);
  }

  // sandboxd's egress proxy answers a refused or failed plain-http request itself.
  const egress = res.headers.get('x-sandboxd-egress');
  if (egress === 'refused' || egress === 'failed') {
    const line = body.text.trim().split('\n')[0];
    const fix = egress === 'refused' ? ' The operator must allow SearXNG\'s host and port in egress.allow.' : '';
    return err(`Could not reach ${where}: ${line || `sandboxd's egress proxy answered HTTP ${res.status}`}.${fix}`);
  }
  if (res.status === 403) {
    return err(`${where} answered HTTP 403 to format=json: the instance has its JSON API turned off. ` +
      'Fix (the operator): in SearXNG\'s settings.yml, under `search:`, set `formats: [html, json]`, then restart SearXNG.');
  }
  if (res.status === 429) {
    return err(`${where} answered HTTP 429 Too Many Requests: its rate limiter refused the search. ` +
      'Wait and retry; the operator can turn `server.limiter` off in settings.yml for an instance only tools use.');
  }
  if (res.status >= 400) {
    const hint = res.status === 404 ? ' Is PI_SEARXNG_URL the base address of a SearXNG instance (the one whose /search answers)?' : '';
    return err(`${where} answered HTTP ${res.status}${res.statusText ? ' ' + res.statusText : ''}: ${excerpt(body.text) || '(no body)'}${hint}`);
  }
  if (body.truncated) return err(`${where} sent more than ${MAX_BYTES >> 20} MiB for one search; that is not a SearXNG answer. Check PI_SEARXNG_URL.`);

  let answer: SearxAnswer;
  try {
    answer = JSON.parse(body.text) as SearxAnswer;
  } catch {
    const type = res.headers.get('content-type') ?? 'no content type';
    return err(`${where} did not answer with JSON (HTTP ${res.status}, ${type}, starting ${JSON.stringify(excerpt(body.text).slice(0, 80))}). ` +
      'Is PI_SEARXNG_URL the base address of a SearXNG instance (the page that has /search)?');
  }
  if (!answer || typeof answer !== 'object' || !Array.isArray(answer.results)) {
    return err(`${where} answered JSON without a "results" list (starting ${JSON.stringify(excerpt(body.text).slice(0, 80))}); is PI_SEARXNG_URL a SearXNG instance?`);
  }

  const results = (answer.results as SearxResult[])
    .filter((r) => r && typeof r === 'object' && typeof r.url === 'string' && r.url)
    .slice(0, wanted);
  const lines: string[] = [];
  const capped = asked > MAX_RESULTS ? ` (max_results is capped at ${MAX_RESULTS})` : '';
  if (!results.length) {
    lines.push(`No results for ${JSON.stringify(query)}${capped}.`);
  } else {
    lines.push(`${results.length} result${results.length === 1 ? '' : 's'} for ${JSON.stringify(query)}${capped}:`);
    results.forEach((r, i) => {
      const snippet = clean(r.content);
      const date = typeof r.publishedDate === 'string' && r.publishedDate ? ` (${r.publishedDate.slice(0, 10)})` : '';
      lines.push('', `${i + 1}. ${clean(r.title) || r.url}${date}`, `   ${r.url}`);
      if (snippet) lines.push(`   ${snippet.length > SNIPPET_CHARS ? snippet.slice(0, SNIPPET_CHARS) + '…' : snippet}`);
    });
  }
  const answers = Array.isArray(answer.answers)
    ? answer.answers.map((a) => clean(typeof a === 'object' && a ? (a as { answer?: unknown }).answer : a)).filter(Boolean)
    : [];
  if (answers.length) lines.push('', `Answer: ${answers.join(' / ')}`);
  const suggestions = [answer.corrections, answer.suggestions]
    .flatMap((list) => (Array.isArray(list) ? list.map(clean) : []))
    .filter(Boolean);
  if (suggestions.length) lines.push('', `Related searches: ${suggestions.slice(0, 8).join('; ')}`);
  if (!results.length && Array.isArray(answer.unresponsive_engines) && answer.unresponsive_engines.length) {
    const engines = answer.unresponsive_engines
      .map((e) => (Array.isArray(e) ? `${clean(e[0])} (${clean(e[1])})` : clean(e)))
      .filter(Boolean);
    lines.push('', `Engines that did not answer: ${engines.join(', ')}. Try again later or rephrase.`);
  }
  return ok(lines.join('\n'));
}
