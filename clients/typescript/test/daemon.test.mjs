// @sandboxd/client against a real `sandboxd serve` and real Docker.

import assert from "node:assert/strict";
import { existsSync, readFileSync } from "node:fs";
import { join } from "node:path";
import { after, before, test } from "node:test";

import { ConnectionLostError, InvalidParamsError, OverloadedError, SandboxdClient } from "../dist/index.js";
import { startDaemon, USER, waitFor } from "../../testing/daemon.mjs";

let daemon;
let client;

before(async () => {
  // max_per_user 2 and a short queue deadline make -32001 quick to provoke.
  daemon = await startDaemon({ config: "pool:\n  max_per_user: 2\n  acquire_timeout_ms: 1500\n  shutdown_grace_s: 0.5\n" });
  client = new SandboxdClient({ socketPath: daemon.socket });
});

after(async () => {
  client?.close();
  await daemon?.dispose();
});

test("tools/list with a user lists their tools with schemas and documentation, and warms their pool", async () => {
  const tools = await client.listTools(USER);
  const names = tools.map((t) => t.name);
  assert.deepEqual(names, [...names].sort()); // sorted by name, as PROTOCOL.md says
  // The test tools and the seed's hello (the seed holds more, which this test does not pin).
  for (const name of ["echo", "fails", "hello", "progress", "sleeper"]) assert.ok(names.includes(name), name);
  const echo = tools.find((t) => t.name === "echo");
  assert.equal(echo.label, "Echo");
  assert.match(echo.documentation, /ECHO-DOC-MARKER/);
  assert.deepEqual(echo.inputSchema.required, ["text"]);
  assert.deepEqual(echo.inputSchema.properties.mode.enum, ["plain", "loud"]);
  assert.equal(echo.inputSchema.properties.token.writeOnly, true);
  // The answer does not wait for the warm-up; the sandbox follows.
  await waitFor(async () => (await client.status()).pool.users[USER]?.idle >= 1, "a warm sandbox for the listing user");
});

test("many calls in flight on one connection, answers matched to their calls, progress to its call", async () => {
  const steps = [];
  const [a, b, p] = await Promise.all([
    client.callTool({ user: USER, name: "echo", arguments: { text: "a" }, toolCallId: "call-a" }),
    client.callTool({ user: USER, name: "echo", arguments: { text: "b", mode: "loud", times: 2 } }),
    client.callTool({ user: USER, name: "progress", arguments: { steps: 4 } }, { onProgress: (u) => steps.push(u) }),
  ]);
  assert.equal(a.status, "ok");
  assert.equal(a.content[0].text, "a");
  assert.equal(JSON.parse(a.content[1].text).toolCallId, "call-a");
  assert.equal(b.content[0].text, "B B");
  assert.equal(p.content[0].text, "did 4 steps");
  assert.deepEqual(steps.map((s) => [s.progress, s.content[0].text]), [[1, "step 1"], [2, "step 2"], [3, "step 3"], [4, "step 4"]]);
});

test("a failing tool is a result with its status, not an exception", async () => {
  const result = await client.callTool({ user: USER, name: "fails" });
  assert.equal(result.status, "error");
  assert.equal(result.isError, true);
  assert.match(result.content[0].text, /quota is exhausted/);
});

test("AbortSignal cancels the call: the tool's own signal fires inside the sandbox", async () => {
  const controller = new AbortController();
  const call = client.callTool({ user: USER, name: "sleeper", arguments: { ms: 60000, mark: "client-abort.txt" } },
    { signal: controller.signal });
  await waitFor(async () => (await client.status()).callsInFlight === 1 && (await client.status()).pool.users[USER]?.busy === 1,
    "the sleeper running");
  controller.abort("stop now");
  const result = await call;
  assert.equal(result.status, "cancelled");
  const mark = join(daemon.userDir(), "client-abort.txt");
  assert.ok(existsSync(mark), "the tool wrote its abort mark");
  assert.match(readFileSync(mark, "utf8"), /stop now/);
});

test("bad params and a full pool come back as typed errors", async () => {
  await assert.rejects(client.callTool({ user: USER, name: "no_such_tool" }), (e) => e instanceof InvalidParamsError && e.code === -32602);
  await assert.rejects(client.callTool({ user: USER, name: "echo", arguments: {}, env: { HOME: "/etc" } }), InvalidParamsError);
  // Two sleepers hold both of the user's sandboxes; a third call queues past acquire_timeout_ms.
  const hold = [1, 2].map(() => client.callTool({ user: USER, name: "sleeper", arguments: { ms: 4000 } }));
  await waitFor(async () => (await client.status()).pool.users[USER]?.busy === 2, "both sandboxes busy");
  await assert.rejects(client.callTool({ user: USER, name: "echo", arguments: { text: "x" } }),
    (e) => e instanceof OverloadedError && e.retryable === true);
  await Promise.all(hold);
});

test("the daemon restarts: a call in flight is answered cancelled, the next call reconnects", async () => {
  const inFlight = client.callTool({ user: USER, name: "sleeper", arguments: { ms: 60000 } });
  await waitFor(async () => (await client.status()).callsInFlight === 1, "the call running");
  await daemon.restart();
  const result = await inFlight;
  assert.equal(result.status, "cancelled");
  // Either the tool settled on its AbortSignal, or the daemon killed it (a shutdown leaves no grace).
  const words = result.content[0].text;
  assert.ok(/shutting down/.test(words) || JSON.parse(words).aborted === true, words);
  assert.equal((await client.callTool({ user: USER, name: "echo", arguments: { text: "again" } })).content[0].text, "again");
});

test("the daemon dies: the call in flight fails with ConnectionLostError, the next call reconnects", async () => {
  const inFlight = client.callTool({ user: USER, name: "sleeper", arguments: { ms: 60000 } });
  await waitFor(async () => (await client.status()).callsInFlight === 1, "the call running");
  const failed = assert.rejects(inFlight, (e) => e instanceof ConnectionLostError && e.message.includes(daemon.socket));
  await daemon.kill();
  await failed;
  await daemon.start();
  assert.equal((await client.callTool({ user: USER, name: "echo", arguments: { text: "back" } })).content[0].text, "back");
});
