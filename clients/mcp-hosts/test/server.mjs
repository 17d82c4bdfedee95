// `sandboxd mcp` as MCP hosts start it: the repo's .venv python, against a test daemon.

import { mkdirSync, writeFileSync } from "node:fs";
import { join } from "node:path";

import { REPO, USER } from "../../testing/daemon.mjs";

export { USER };
export const PYTHON = join(REPO, ".venv", "bin", "python");

/** The command line an MCP host's config names, for `daemon`'s user. */
export function mcpArgs(daemon, ...extra) {
  return ["-m", "sandboxd", "mcp", "--user", USER, "--socket", daemon.socket, "--config", daemon.configPath, ...extra];
}

/** This machine's environment without SANDBOXD_* (which would change what runs), plus `extra`. */
export function serverEnv(extra = {}) {
  const env = Object.fromEntries(Object.entries(process.env).filter(([k]) => !k.startsWith("SANDBOXD_")));
  return { ...env, ...extra };
}

export const text = (result) => result.content.filter((c) => c.type === "text").map((c) => c.text).join("\n");

/**
 * A user tool that reports progress while it works (100 ms apart), as a long tool does.
 * The TypeScript SDK's client handles progress a microtask after the message that carries
 * it but a response at once, so an update that arrives in the same read as the answer is
 * dropped (its handler is gone); updates sent while a tool works are not.
 */
export function tickerTool(userDir) {
  const dir = join(userDir, "tools", "ticker");
  mkdirSync(dir, { recursive: true });
  writeFileSync(join(dir, "TOOL.md"), "---\nname: ticker\ndescription: Reports progress while it works.\nversion: 1\n"
    + "inputs:\n  steps:\n    type: number\n    description: How many ticks.\n---\n# ticker\n");
  writeFileSync(join(dir, "index.ts"), "export async function execute(_id: string, p: { steps: number }, _s?: AbortSignal,\n"
    + "  onUpdate?: (u: unknown) => void) {\n"
    + "  for (let i = 1; i <= p.steps; i++) {\n"
    + "    onUpdate?.({ content: [{ type: 'text', text: `tick ${i}` }] });\n"
    + "    await new Promise((r) => setTimeout(r, 100));\n"
    + "  }\n"
    + "  return { content: [{ type: 'text', text: `ticked ${p.steps} times` }] };\n}\n");
}
