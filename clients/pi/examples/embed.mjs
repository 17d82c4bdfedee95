// Embedding @sandboxd/pi in pi's SDK, as pi-bridge does: a session for one user, with that
// user's sandboxd tools in it. Offline: pi-ai's faux model stands in for the model and
// scripts one turn that calls the `hello` tool, then a closing answer.
//
//   node examples/embed.mjs a@example.com     # SANDBOXD_SOCKET if sandboxd is not on /run/sandboxd/sandboxd.sock
//
// With a real model: drop registerFauxProvider, pass `model: getModel("anthropic", "claude-...")`
// (from @mariozechner/pi-ai) and an AuthStorage that holds the provider's key.

import { mkdtempSync, rmSync } from "node:fs";
import { tmpdir } from "node:os";
import { join } from "node:path";

import { fauxAssistantMessage, fauxToolCall, registerFauxProvider } from "@mariozechner/pi-ai";
import {
  AuthStorage,
  createAgentSession,
  DefaultResourceLoader,
  ModelRegistry,
  SessionManager,
  SettingsManager,
} from "@mariozechner/pi-coding-agent";
import { createSandboxdExtension } from "@sandboxd/pi";

const user = process.argv[2] ?? process.env.SANDBOXD_USER;
if (!user) {
  console.error("usage: node examples/embed.mjs USER   (the email address whose sandboxd tools the session gets)");
  process.exit(2);
}

// The model: scripted. Turn 1 calls hello; turn 2 answers once the tool's result is in.
const faux = registerFauxProvider();
faux.setResponses([
  fauxAssistantMessage([fauxToolCall("hello", { name: "pi" }, { id: "call_hello" })], { stopReason: "toolUse" }),
  fauxAssistantMessage("Greeted."),
]);
const authStorage = AuthStorage.inMemory();
authStorage.setRuntimeApiKey("faux", "offline");

const dir = mkdtempSync(join(tmpdir(), "sandboxd-pi-example-"));
const settingsManager = SettingsManager.inMemory();
const resourceLoader = new DefaultResourceLoader({
  cwd: dir,
  agentDir: join(dir, "agent"),
  settingsManager,
  extensionFactories: [
    // socketPath defaults to SANDBOXD_SOCKET, then /run/sandboxd/sandboxd.sock. `env` holds the
    // integration variables the user's calls get (only the names the daemon allows are passed).
    createSandboxdExtension({ user, socketPath: process.env.SANDBOXD_SOCKET, env: { PI_SEARXNG_URL: process.env.PI_SEARXNG_URL } }),
  ],
  noSkills: true,
  noPromptTemplates: true,
  noThemes: true,
  noContextFiles: true,
});
await resourceLoader.reload();
const { session } = await createAgentSession({
  cwd: dir,
  agentDir: join(dir, "agent"),
  model: faux.getModel(),
  authStorage,
  modelRegistry: ModelRegistry.inMemory(authStorage),
  resourceLoader,
  sessionManager: SessionManager.inMemory(),
  settingsManager,
  noTools: "builtin", // only sandboxd's tools
});
// session_start: the extension lists the user's tools (warming their sandboxes) and registers
// them. pi's own modes call this; an embedding must, or every call is "Tool hello not found".
await session.bindExtensions({});

let failed = false;
try {
  const tools = session.getAllTools().filter((tool) => tool.sourceInfo.source !== "builtin").map((tool) => tool.name);
  console.log(`tools of ${user}: ${tools.join(", ") || "(none)"}`);
  await session.prompt("Say hello to pi.");
  for (const message of session.messages.filter((m) => m.role === "toolResult")) {
    const text = message.content.filter((c) => c.type === "text").map((c) => c.text).join("\n");
    console.log(`${message.toolName} → ${text} (${JSON.stringify(message.details)})`);
    failed ||= message.isError;
  }
  const answer = session.messages.at(-1);
  console.log(`model: ${answer.content.filter((c) => c.type === "text").map((c) => c.text).join("")}`);
} finally {
  session.dispose();
  faux.unregister();
  rmSync(dir, { recursive: true, force: true });
}
process.exit(failed ? 1 : 0);
