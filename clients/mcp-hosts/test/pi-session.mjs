// A real pi agent session, offline (pi-ai's faux model scripts the turns), with pi-mcp-adapter
// loaded the way pi loads a package, and an MCP config in the session's project folder.

import { mkdirSync, mkdtempSync, rmSync, writeFileSync } from "node:fs";
import { tmpdir } from "node:os";
import { dirname, join, resolve } from "node:path";
import { fileURLToPath } from "node:url";

import { registerFauxProvider } from "@earendil-works/pi-ai";
import {
  AuthStorage,
  createAgentSession,
  DefaultResourceLoader,
  ModelRegistry,
  SessionManager,
  SettingsManager,
} from "@earendil-works/pi-coding-agent";

const ADAPTER = resolve(dirname(fileURLToPath(import.meta.url)), "..", "node_modules", "pi-mcp-adapter");

/** A session whose project `.mcp.json` is `mcpConfig`; HOME is a fresh folder, so no config of this machine's counts. */
export async function piSession(mcpConfig) {
  const dir = mkdtempSync(join(tmpdir(), "sbd-pi-mcp-"));
  const home = join(dir, "home");
  mkdirSync(home);
  process.env.HOME = home;
  const cwd = join(dir, "project");
  mkdirSync(cwd);
  writeFileSync(join(cwd, ".mcp.json"), JSON.stringify(mcpConfig, null, 2));
  const faux = registerFauxProvider();
  const authStorage = AuthStorage.inMemory();
  authStorage.setRuntimeApiKey("faux", "offline");
  const settingsManager = SettingsManager.inMemory();
  const agentDir = join(dir, "agent");
  const resourceLoader = new DefaultResourceLoader({
    cwd, agentDir, settingsManager, additionalExtensionPaths: [ADAPTER],
    noSkills: true, noPromptTemplates: true, noThemes: true, noContextFiles: true,
  });
  await resourceLoader.reload();
  const { session, extensionsResult } = await createAgentSession({
    cwd, agentDir, model: faux.getModel(), authStorage, modelRegistry: ModelRegistry.inMemory(authStorage),
    resourceLoader, sessionManager: SessionManager.inMemory(), settingsManager, noTools: "builtin",
  });
  const errors = extensionsResult.errors ?? [];
  if (errors.length > 0) throw new Error(`pi could not load pi-mcp-adapter: ${JSON.stringify(errors)}`);
  await session.bindExtensions({}); // emits session_start, as pi's modes do
  return {
    session,
    faux,
    toolResults() {
      return new Map(session.messages.filter((m) => m.role === "toolResult").map((m) => [m.toolCallId, m]));
    },
    /** End the session as pi does when it quits: session_shutdown first (the adapter stops its servers). */
    async dispose() {
      await session.extensionRunner.emit({ type: "session_shutdown", reason: "quit" });
      session.dispose();
      faux.unregister();
      rmSync(dir, { recursive: true, force: true });
    },
  };
}
