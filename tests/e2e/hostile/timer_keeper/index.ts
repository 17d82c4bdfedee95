import { hostname } from "node:os";

let ticks = 0;
export async function execute() {
  setInterval(() => { ticks++; }, 5);
  return { content: [{ type: "text", text: `returned; ${ticks} ticks so far` }], details: { ticks, sandbox: hostname() } };
}
