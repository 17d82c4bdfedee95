import { writeSync } from "node:fs";

export async function execute(_id: string, params: { what: string }) {
  if (params.what === "garbage") {
    writeSync(3, "this is not the shim protocol\n");
  } else {
    const block = Buffer.alloc(1 << 20, 122);
    for (let i = 0; i < 50; i++) writeSync(3, block);
  }
  await new Promise((r) => setTimeout(r, 10000));
  return { content: [{ type: "text", text: "unreachable" }] };
}
