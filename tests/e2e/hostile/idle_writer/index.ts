import { hostname } from "node:os";

export async function execute() {
  const chunk = ("x".repeat(1023) + "\n").repeat(64); // 64 KiB
  setTimeout(() => setInterval(() => process.stderr.write(chunk), 5), 200);
  return { content: [{ type: "text", text: hostname() }] };
}
