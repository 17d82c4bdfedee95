import { execFile } from "node:child_process";
import { readFileSync } from "node:fs";
import * as http from "node:http";
import * as net from "node:net";

type Params = { mode: string; url?: string; request?: string; host?: string; port?: number; seconds?: number };

const EGRESS_SOCKET = "/officer/run/egress.sock";

function report(value: unknown) {
  return { content: [{ type: "text" as const, text: JSON.stringify(value) }], details: value };
}

function describe(error: any): Record<string, unknown> {
  return { error: String(error?.message ?? error), code: error?.code, cause: error?.cause ? String(error.cause.message ?? error.cause) : undefined };
}

function raw(request: string): Promise<unknown> {
  return new Promise((resolve) => {
    const chunks: Buffer[] = [];
    const sock = net.connect({ path: EGRESS_SOCKET });
    sock.on("connect", () => sock.write(request));
    sock.on("data", (d) => chunks.push(d));
    sock.on("error", (e) => resolve(describe(e)));
    sock.on("close", () => resolve({ answer: Buffer.concat(chunks).toString("utf8") }));
    setTimeout(() => { sock.destroy(); resolve({ answer: Buffer.concat(chunks).toString("utf8"), timeout: true }); }, 15000);
  });
}

/** Open `count` connections that never send a request, then one that does: what does it get? */
async function hold(count: number, request: string): Promise<unknown> {
  const held: net.Socket[] = [];
  for (let i = 0; i < count; i++) {
    const sock = net.connect({ path: EGRESS_SOCKET });
    sock.on("error", () => {});
    await new Promise((resolve) => sock.once("connect", resolve));
    held.push(sock);
  }
  await new Promise((resolve) => setTimeout(resolve, 200)); // each accepted by the daemon
  const answer = await raw(request);
  for (const sock of held) sock.destroy();
  return answer;
}

/** Read `url`'s body for `seconds`, dropping it: how many bytes got through. */
async function pump(url: string, seconds: number): Promise<unknown> {
  const started = Date.now();
  const controller = new AbortController();
  const timer = setTimeout(() => controller.abort(), seconds * 1000);
  let bytes = 0;
  try {
    const res = await fetch(url, { signal: controller.signal });
    const reader = res.body!.getReader();
    for (;;) {
      const { done, value } = await reader.read();
      if (done) break;
      bytes += value.byteLength;
    }
  } catch (e: any) {
    if (e?.name !== "AbortError") return { ...describe(e), bytes };
  } finally {
    clearTimeout(timer);
  }
  return { bytes, ms: Date.now() - started };
}

/** `loops` loops sending `request` on a fresh egress connection each, as fast as they can, for `seconds`. */
async function flood(request: string, loops: number, seconds: number): Promise<unknown> {
  const until = Date.now() + seconds * 1000;
  const counts: Record<string, number> = {};
  const one = () => new Promise<string>((resolve) => {
    const sock = net.connect({ path: EGRESS_SOCKET });
    let head = "";
    sock.on("connect", () => sock.write(request));
    sock.on("data", (d) => { head += d.toString("latin1"); });
    sock.on("error", (e: any) => resolve(`error ${e?.code ?? e}`));
    sock.on("close", () => resolve(head.split("\r\n")[0] || "closed"));
  });
  await Promise.all(Array.from({ length: loops }, async () => {
    while (Date.now() < until) {
      const outcome = await one();
      counts[outcome] = (counts[outcome] ?? 0) + 1;
    }
  }));
  return counts;
}

function viaHttp(url: string): Promise<unknown> {
  return new Promise((resolve) => {
    const req = http.get(url, (res) => {
      let body = "";
      res.on("data", (d) => (body += d));
      res.on("end", () => resolve({ status: res.statusCode, body }));
    });
    req.on("error", (e) => resolve(describe(e)));
    req.setTimeout(15000, () => req.destroy(new Error("timed out")));
  });
}

function viaPython(url: string): Promise<unknown> {
  const script = "import sys, urllib.request\n" +
    "try:\n  print(urllib.request.urlopen(sys.argv[1], timeout=15).read().decode())\n" +
    "except Exception as e:\n  print('ERROR', e)\n";
  return new Promise((resolve) => {
    execFile("python3", ["-c", script, url], { timeout: 20000 }, (error, stdout, stderr) =>
      resolve({ stdout: String(stdout).trim(), stderr: String(stderr).trim(), error: error ? String(error.message) : undefined }));
  });
}

function direct(host: string, port: number): Promise<unknown> {
  return new Promise((resolve) => {
    const started = Date.now();
    const sock = net.connect({ host, port });
    sock.on("connect", () => { sock.destroy(); resolve({ connected: true }); });
    sock.on("error", (e: any) => resolve({ ...describe(e), ms: Date.now() - started }));
    setTimeout(() => { sock.destroy(); resolve({ timeout: true }); }, 15000);
  });
}

export async function execute(_id: string, params: Params) {
  switch (params.mode) {
    case "routes":
      return report({
        route: readFileSync("/proc/net/route", "utf8"),
        ipv6_route: readFileSync("/proc/net/ipv6_route", "utf8"),
        dev: readFileSync("/proc/net/dev", "utf8"),
        env: Object.keys(process.env).filter((k) => /proxy|EGRESS/i.test(k)),
      });
    case "raw":
      return report(await raw(params.request ?? ""));
    case "hold":
      return report(await hold(params.port ?? 0, params.request ?? ""));
    case "parallel": // `port` connections at once, each sending `request` with {i} its number
      return report(await Promise.all(Array.from({ length: params.port ?? 1 }, (_, i) =>
        raw((params.request ?? "").replaceAll("{i}", String(i))))));
    case "fetch":
      try {
        const res = await fetch(params.url!, { signal: AbortSignal.timeout(15000) });
        return report({ status: res.status, body: await res.text(), url: res.url });
      } catch (e) {
        return report(describe(e));
      }
    case "download":
      try {
        const started = Date.now();
        const res = await fetch(params.url!, { signal: AbortSignal.timeout(60000) });
        const bytes = (await res.arrayBuffer()).byteLength;
        return report({ status: res.status, bytes, ms: Date.now() - started });
      } catch (e) {
        return report(describe(e));
      }
    case "pump":
      return report(await pump(params.url!, params.seconds ?? 10));
    case "flood":
      return report(await flood(params.request ?? "", params.port ?? 1, params.seconds ?? 10));
    case "http":
      return report(await viaHttp(params.url!));
    case "python":
      return report(await viaPython(params.url!));
    case "direct":
      return report(await direct(params.host!, params.port!));
    default:
      throw new Error(`unknown mode ${params.mode}`);
  }
}
