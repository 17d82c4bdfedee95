import { appendFileSync } from "node:fs";
import { hostname } from "node:os";

export async function execute(_id: string, params: { path: string; everyMs: number; holdMs?: number }) {
  const block = Buffer.alloc(1 << 20, 119);
  const write = () => { try { appendFileSync(params.path, block); } catch { /* full: try again next tick */ } };
  const timer = setInterval(write, params.everyMs);
  if (params.holdMs) {
    await new Promise((resolve) => setTimeout(resolve, params.holdMs));
    clearInterval(timer);
  }
  return { content: [{ type: "text", text: `writing to ${params.path}` }], details: { sandbox: hostname() } };
}
