import { hostname } from "node:os";

export async function execute(_id: string, params: { ms: number }) {
  await new Promise((r) => setTimeout(r, params.ms));
  return { content: [{ type: "text", text: `resolved after ${params.ms} ms` }], details: { sandbox: hostname() } };
}
