// A real pi agent session, offline: pi-ai's faux model scripts the turns, the
// extension is loaded the way pi loads a package (from this folder), or from its factory.

import { mkdtempSync, rmSync } from "node:fs";
import { tmpdir } from "node:os";
import { dirname, join, resolve } from "node:path";
import { fileURLToPath } from "node:url";

import { registerFauxProvider } from "@mariozechner/pi-ai";
import {
  AuthStorage,
  createAgentSession,
  DefaultResourceLoader,
  ModelRegistry,
  SessionManager,
  SettingsManager,
} from "@mariozechner/pi-coding-agent";

export const PACKAGE_DIR = resolve(dirname(fileURLToPath(import.meta.url)), "..");

/**
 * A session with the faux model. `extensionPaths` are loaded as pi loads packages;
 * `extensionFactories` as pi-bridge embeds them. Returns the session, the faux
 * registration (to script turns) and what the model was shown at each turn.
 */
export async function piSession({ extensionPaths = [], extensionFactories = [] } = {}) {
  const dir = mkdtempSync(join(tmpdir(), "sbd-pi-"));
  const faux = registerFauxProvider();
  const authStorage = AuthStorage.inMemory();
  authStorage.setRuntimeApiKey("faux", "offline");
  const settingsManager = SettingsManager.inMemory();
  const resourceLoader = new DefaultResourceLoader({
    cwd: dir,
    agentDir: join(dir, "agent"),
    settingsManager,
    additionalExtensionPaths: extensionPaths,
    extensionFactories,
    noSkills: true,
    noPromptTemplates: true,
    noThemes: true,
    noContextFiles: true,
  });
  await resourceLoader.reload();
  const { session, extensionsResult } = await createAgentSession({
    cwd: dir,
    agentDir: join(dir, "agent"),
    model: faux.getModel(),
    authStorage,
    modelRegistry: ModelRegistry.inMemory(authStorage),
    resourceLoader,
    sessionManager: SessionManager.inMemory(),
    settingsManager,
    noTools: "builtin",
  });
  const errors = extensionsResult.errors ?? [];
  if (errors.length > 0) throw new Error(`pi could not load the extension: ${JSON.stringify(errors)}`);
  await session.bindExtensions({}); // emits session_start, as pi's modes do
  return {
    session,
    faux,
    /** The tool results of the session, by toolCallId. */
    toolResults() {
      return new Map(session.messages.filter((m) => m.role === "toolResult").map((m) => [m.toolCallId, m]));
    },
    dispose() {
      session.dispose();
      faux.unregister();
      rmSync(dir, { recursive: true, force: true });
    },
  };
}

export const text = (message) => message.content.filter((c) => c.type === "text").map((c) => c.text).join("\n");
