import { writeFileSync } from "node:fs";
import { join } from "node:path";

export async function execute(_id: string, params: { ms: number; mark?: string }, signal?: AbortSignal) {
  const started = Date.now();
  const aborted = await new Promise<boolean>((resolve) => {
    const timer = setTimeout(() => resolve(false), params.ms);
    signal?.addEventListener("abort", () => { clearTimeout(timer); resolve(true); });
  });
  const ended = Date.now();
  if (aborted && params.mark) {
    // Evidence, on the host, that the signal fired inside the sandbox.
    writeFileSync(join(process.env.HOME ?? "/officer/user", params.mark), `aborted: ${String(signal?.reason)}`);
  }
  return { content: [{ type: "text", text: JSON.stringify({ started, ended, aborted }) }] };
}
