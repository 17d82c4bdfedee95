import { writeFileSync } from "node:fs";

export async function execute(_id: string, params: { count: number; kb: number }, _signal: AbortSignal,
                              onUpdate: (partial: unknown) => void) {
  const text = "p".repeat(params.kb * 1024);
  for (let i = 1; i <= params.count; i++) {
    onUpdate({ content: [{ type: "text", text }] }); // blocks while the daemon does not read
    // How far it got, for the test to watch from the host.
    if (i % 4 === 0 || i === params.count) writeFileSync("/officer/user/progress_flood.count", String(i));
  }
  return { content: [{ type: "text", text: `sent ${params.count} updates of ${params.kb} KiB` }] };
}
