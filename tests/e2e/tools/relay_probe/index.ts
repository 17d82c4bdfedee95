import { createHash, randomBytes } from "node:crypto";
import * as http from "node:http";
import * as net from "node:net";

type Params = { mode: string; host?: string; port?: number; request?: string; count?: number };

const EGRESS_SOCKET = "/officer/run/egress.sock";
const WS_GUID = "258EAFA5-E914-47DA-95CA-C5AB0DC85B11";

function report(value: unknown) {
  return { content: [{ type: "text" as const, text: JSON.stringify(value) }], details: value };
}

function describe(error: any): Record<string, unknown> {
  return { error: String(error?.message ?? error), code: error?.code };
}

/** Bytes from a socket as they come: `next(n)` is the next n of them, `until(marker)` up to and with it. */
function reader(sock: net.Socket) {
  let buf = Buffer.alloc(0);
  let ended: Error | null = null;
  let wake: (() => void) | null = null;
  sock.on("data", (d: Buffer) => { buf = Buffer.concat([buf, d]); wake?.(); });
  const stop = (e: Error) => { ended ??= e; wake?.(); };
  sock.on("error", stop);
  sock.on("close", () => stop(new Error(`connection closed (${buf.length} bytes unread)`)));
  const more = async () => {
    if (ended) throw ended;
    await new Promise<void>((resolve) => { wake = () => { wake = null; resolve(); }; });
  };
  return {
    async next(n: number): Promise<Buffer> {
      while (buf.length < n) await more();
      const out = buf.subarray(0, n);
      buf = buf.subarray(n);
      return out;
    },
    async until(marker: string): Promise<string> {
      let at: number;
      while ((at = buf.indexOf(marker)) < 0) await more();
      const out = buf.subarray(0, at + marker.length);
      buf = buf.subarray(at + marker.length);
      return out.toString("latin1");
    },
    unshift(b: Buffer) { buf = Buffer.concat([b, buf]); },
  };
}

function connect(host: string, port: number): Promise<net.Socket> {
  return new Promise((resolve, reject) => {
    const sock = net.connect({ host, port });
    sock.once("connect", () => resolve(sock));
    sock.once("error", reject);
  });
}

async function tcp(host: string, port: number): Promise<unknown> {
  const sock = await connect(host, port);
  const r = reader(sock);
  sock.write("round trip\n");
  const reply = await r.until("\n");
  sock.destroy();
  return { reply: reply.trim() };
}

function frame(text: string): Buffer {
  const payload = Buffer.from(text);
  const mask = randomBytes(4);
  const head = Buffer.from([0x81, 0x80 | payload.length]);  // FIN + text; masked, as a client must
  return Buffer.concat([head, mask, Buffer.from(payload.map((b, i) => b ^ mask[i % 4]))]);
}

async function readFrame(r: ReturnType<typeof reader>): Promise<{ opcode: number; text: string }> {
  const [b0, b1] = await r.next(2);
  let length = b1 & 0x7f;
  if (length === 126) length = (await r.next(2)).readUInt16BE(0);
  return { opcode: b0 & 0x0f, text: (await r.next(length)).toString() };
}

/** After the 101: the relay's greeting, then a message each way. */
async function converse(sock: net.Socket, r: ReturnType<typeof reader>, status: number, accept: string, key: string) {
  const expected = createHash("sha1").update(key + WS_GUID).digest("base64");
  const hello = await readFrame(r);
  sock.write(frame("ping from the sandbox"));
  const echo = await readFrame(r);
  sock.write(Buffer.from([0x88, 0x80, 0, 0, 0, 0]));  // close, masked, no body
  sock.destroy();
  return { status, acceptOk: accept === expected, hello: hello.text, echo: echo.text };
}

async function websocket(host: string, port: number): Promise<unknown> {
  const sock = await connect(host, port);
  const r = reader(sock);
  const key = randomBytes(16).toString("base64");
  sock.write(`GET /extension?token=relay-token HTTP/1.1\r\nHost: ${host}:${port}\r\nUpgrade: websocket\r\n` +
            `Connection: Upgrade\r\nSec-WebSocket-Key: ${key}\r\nSec-WebSocket-Version: 13\r\n\r\n`);
  const head = await r.until("\r\n\r\n");
  const status = Number(head.split(" ")[1]);
  const accept = /sec-websocket-accept: *(\S+)/i.exec(head)?.[1] ?? "";
  return converse(sock, r, status, accept, key);
}

function httpUpgrade(host: string, port: number): Promise<unknown> {
  const key = randomBytes(16).toString("base64");
  return new Promise((resolve) => {
    const req = http.request({ host, port, path: "/extension", headers: {
      Upgrade: "websocket", Connection: "Upgrade", "Sec-WebSocket-Key": key, "Sec-WebSocket-Version": "13" } });
    req.on("upgrade", (res, sock, rest) => {
      const r = reader(sock);
      if (rest.length) r.unshift(rest);
      converse(sock, r, res.statusCode ?? 0, String(res.headers["sec-websocket-accept"] ?? ""), key)
        .then(resolve, (e) => resolve(describe(e)));
    });
    req.on("response", (res) => resolve({ status: res.statusCode }));
    req.on("error", (e) => resolve(describe(e)));
    req.end();
  });
}

/** `count` connections kept open (each round-tripped first), then one more: does it get through? */
const held: net.Socket[] = [];
async function hold(host: string, port: number, count: number): Promise<unknown> {
  const opened = [];
  for (let i = 0; i < count; i++) {
    try {
      const sock = await connect(host, port);
      const r = reader(sock);
      sock.write(`held ${i}\n`);
      opened.push((await r.until("\n")).trim());
      held.push(sock);
    } catch (e) {
      opened.push(describe(e));
    }
  }
  let next: unknown;
  try {
    next = await tcp(host, port);
  } catch (e) {
    next = describe(e);
  }
  for (const sock of held.splice(0)) sock.destroy();
  return { opened, next };
}

export async function execute(_id: string, params: Params) {
  const host = params.host ?? "127.0.0.1";
  const port = params.port ?? Number(process.env.OFFICER_BROWSER_RELAY_PORT);
  try {
    switch (params.mode) {
      case "tcp":
        return report(await tcp(host, port));
      case "websocket":
        return report(await websocket(host, port));
      case "http-upgrade":
        return report(await httpUpgrade(host, port));
      case "fetch": {
        const res = await fetch(`http://${host}:${port}/`, { signal: AbortSignal.timeout(15000) });
        return report({ status: res.status, body: await res.text() });
      }
      case "hold":
        return report(await hold(host, port, params.count ?? 1));
      case "later":  // `request` on the egress socket, after this call has been answered
        setTimeout(() => {
          const sock = net.connect({ path: EGRESS_SOCKET }, () => sock.end(params.request ?? ""));
          sock.on("error", () => {});
          sock.resume();
        }, 300);
        return report({ scheduled: true });
      default:
        throw new Error(`unknown mode ${params.mode}`);
    }
  } catch (e) {
    return report(describe(e));
  }
}
