import * as net from "node:net";

const CHUNK = Buffer.alloc(64 << 10, 120);

/** Open `count` CONNECT tunnels to `target`; on each, write without end and never read; hold them for `seconds`. */
export async function execute(_id: string, params: { target: string; count: number; seconds: number }) {
  const outcomes: Record<string, number> = {};
  const all: net.Socket[] = [];
  const one = () => new Promise<void>((resolve) => {
    const sock = net.connect({ path: "/officer/run/egress.sock" });
    all.push(sock);
    let head = "";
    let done = false;
    const finish = (outcome: string) => {
      if (!done) { done = true; outcomes[outcome] = (outcomes[outcome] ?? 0) + 1; resolve(); }
    };
    // Writes until the socket takes no more, then again whenever it drains: the proxy always has bytes to move.
    const push = () => {
      while (!sock.destroyed && sock.write(CHUNK)) { /* until the buffer is full */ }
      if (!sock.destroyed) sock.once("drain", push);
    };
    sock.on("connect", () => sock.write(`CONNECT ${params.target} HTTP/1.1\r\n\r\n`));
    sock.on("data", (d) => {
      if (done) return;
      head += d.toString("latin1");
      if (head.includes("\r\n\r\n")) {
        sock.pause(); // never read again: what the upstream sends stays in the proxy
        finish(head.split("\r\n")[0]);
        if (head.startsWith("HTTP/1.1 200")) push();
      }
    });
    sock.on("error", (e: any) => finish(`error ${e?.code ?? e}`));
    sock.on("close", () => finish(head.split("\r\n")[0] || "closed"));
    setTimeout(() => finish("waiting"), params.seconds * 1000);
  });
  await Promise.all(Array.from({ length: params.count }, one));
  await new Promise((r) => setTimeout(r, params.seconds * 1000));
  for (const sock of all) sock.destroy();
  return { content: [{ type: "text" as const, text: JSON.stringify(outcomes) }] };
}
