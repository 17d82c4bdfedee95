import { hostname } from "node:os";

type Block = { type: string; text: string };
export async function execute(_id: string, params: { ms: number }, _signal?: AbortSignal,
  onUpdate?: (p: { content: Block[] }) => void) {
  onUpdate?.({ content: [{ type: "text", text: "waiting" }] }); // it runs: evidence for the test
  await new Promise((r) => setTimeout(r, params.ms));
  return { content: [{ type: "text", text: `resolved after ${params.ms} ms` }], details: { sandbox: hostname() } };
}
