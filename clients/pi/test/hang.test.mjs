// pi has no tool timeout of its own: a sandboxd that stops answering must not freeze the
// session. A scripted socket lists one tool, then never answers its call.

import assert from "node:assert/strict";
import { mkdtempSync, rmSync } from "node:fs";
import net from "node:net";
import { tmpdir } from "node:os";
import { join } from "node:path";
import { test } from "node:test";

import { fauxAssistantMessage, fauxToolCall } from "@mariozechner/pi-ai";
import { SandboxdClient } from "@sandboxd/client";

import { createSandboxdExtension } from "../dist/index.js";
import { waitFor } from "../../testing/daemon.mjs";
import { piSession, text } from "./session.mjs";

const TOOL = {
  name: "stuck", label: "Stuck", description: "Never answers.", version: 1, language: "typescript", source: "global",
  inputSchema: { type: "object", properties: {}, required: [], additionalProperties: false }, documentation: "# Stuck",
};

test("a call sandboxd never answers fails at the client's deadline, is cancelled, and the turn goes on", { timeout: 30_000 }, async () => {
  const dir = mkdtempSync(join(tmpdir(), "sbd-hang-"));
  const path = join(dir, "s.sock");
  const received = [];
  const server = net.createServer((socket) => {
    let buffer = "";
    socket.on("data", (data) => {
      buffer += data;
      let end;
      while ((end = buffer.indexOf("\n")) >= 0) {
        const message = JSON.parse(buffer.slice(0, end));
        buffer = buffer.slice(end + 1);
        received.push(message);
        const result = message.method === "tools/list" ? { tools: [TOOL] }
          : message.method === "sandbox/status" ? { limits: { allowedEnv: [] } } : undefined;
        if (result !== undefined) socket.write(JSON.stringify({ jsonrpc: "2.0", id: message.id, result }) + "\n");
      }
    });
  });
  await new Promise((resolve) => server.listen(path, resolve));
  const client = new SandboxdClient({ socketPath: path, deadlineGraceMs: 300 });
  const pi = await piSession({ extensionFactories: [createSandboxdExtension({ user: "a@x.io", client, timeoutMs: 200 })] });
  try {
    pi.faux.setResponses([
      fauxAssistantMessage([fauxToolCall("stuck", {}, { id: "call_stuck" })], { stopReason: "toolUse" }),
      fauxAssistantMessage("moved on"),
    ]);
    const started = Date.now();
    await pi.session.prompt("go");
    const elapsed = Date.now() - started;
    assert.ok(elapsed < 10_000, `the turn took ${elapsed} ms`);
    const result = pi.toolResults().get("call_stuck");
    assert.equal(result.isError, true);
    assert.match(text(result), /did not answer tools\/call within 500 ms/);
    assert.equal(text(pi.session.messages.at(-1)), "moved on");
    const call = received.find((m) => m.method === "tools/call");
    assert.equal(call.params.timeoutMs, 200);
    await waitFor(() => received.some((m) => m.method === "notifications/cancelled" && m.params.requestId === call.id),
      "the call's cancel at the socket");
  } finally {
    pi.dispose();
    client.close();
    await new Promise((resolve) => server.close(resolve));
    rmSync(dir, { recursive: true, force: true });
  }
});
