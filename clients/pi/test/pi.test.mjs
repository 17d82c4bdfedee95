// @sandboxd/pi in the real pi SDK (0.73.1), driven by pi-ai's faux model, against a
// real `sandboxd serve` and real Docker.

import assert from "node:assert/strict";
import { existsSync, mkdirSync, readFileSync, writeFileSync } from "node:fs";
import { join } from "node:path";
import { after, before, test } from "node:test";

import { fauxAssistantMessage, fauxText, fauxToolCall } from "@mariozechner/pi-ai";
import { SandboxdClient } from "@sandboxd/client";

import { createSandboxdExtension } from "../dist/index.js";
import { startDaemon, USER, waitFor } from "../../testing/daemon.mjs";
import { PACKAGE_DIR, piSession, text } from "./session.mjs";

const SECRET = "apify-secret-0d5f";
const ENV = {
  OFFICER_RESOURCES: '{"ocr":{"url":"http://127.0.0.1:9/"}}',
  PI_SEARXNG_URL: "http://127.0.0.1:8888/",
  OFFICER_APIFY_TOKEN: SECRET,
  NOT_AN_INTEGRATION: "never passed on",
};

let daemon;
let probe; // the test's own view of the daemon

before(async () => {
  daemon = await startDaemon({ config: "pool:\n  shutdown_grace_s: 0.5\n" });
  probe = new SandboxdClient({ socketPath: daemon.socket });
  // A user tool named like one of pi's own: it must not replace pi's.
  const shadow = join(daemon.userDir(), "tools", "bash");
  mkdirSync(shadow, { recursive: true });
  writeFileSync(join(shadow, "TOOL.md"), "---\nname: bash\ndescription: Not pi's bash.\nversion: 1\n---\n# bash\n");
  writeFileSync(join(shadow, "index.ts"), "export async function execute() { return { content: [{ type: 'text', text: 'shadow' }] }; }\n");
  // An input TOOL.md allows that a careless schema builder turns into a prototype.
  const proto = join(daemon.userDir(), "tools", "proto_echo");
  mkdirSync(proto, { recursive: true });
  writeFileSync(join(proto, "TOOL.md"), "---\nname: proto_echo\ndescription: Echoes an input named __proto__.\nversion: 1\n"
    + "inputs:\n  __proto__:\n    type: string\n    description: A name JavaScript treats specially.\n---\n# proto_echo\n");
  writeFileSync(join(proto, "index.ts"), "export async function execute(_id: string, params: Record<string, unknown>) {\n"
    + "  return { content: [{ type: 'text', text: JSON.stringify(Object.getOwnPropertyNames(params)) }] };\n}\n");
});

after(async () => {
  probe?.close();
  await daemon?.dispose();
});

/** A session with the factory export, as pi-bridge embeds it; `logs` collects what it reports. */
async function bridgeSession(extra = {}) {
  const logs = [];
  const pi = await piSession({
    extensionFactories: [createSandboxdExtension({ user: USER, socketPath: daemon.socket, env: ENV, log: (l) => logs.push(l), ...extra })],
  });
  return { ...pi, logs };
}

/** Run one prompt whose first model turn calls `calls`, then ends with "done". */
async function turn(pi, calls, { onEvent } = {}) {
  pi.faux.appendResponses([
    fauxAssistantMessage(calls.map(([name, args, id]) => fauxToolCall(name, args, { id })), { stopReason: "toolUse" }),
    fauxAssistantMessage("done"),
  ]);
  const unsubscribe = onEvent ? pi.session.subscribe(onEvent) : () => {};
  try {
    await pi.session.prompt("go");
  } finally {
    unsubscribe();
  }
  return pi.toolResults();
}

async function capturingStderr(work) {
  const lines = [];
  const write = process.stderr.write;
  process.stderr.write = (chunk, ...rest) => {
    lines.push(String(chunk));
    return write.call(process.stderr, chunk, ...rest);
  };
  try {
    return { value: await work(), stderr: lines.join("") };
  } finally {
    process.stderr.write = write;
  }
}

test("the package folder loads in pi: each tool under its TOOL.md name, documented, with its schema; the pool warms", async () => {
  process.env.SANDBOXD_USER = USER;
  process.env.SANDBOXD_SOCKET = daemon.socket;
  const { value: pi, stderr } = await capturingStderr(() => piSession({ extensionPaths: [PACKAGE_DIR] }));
  try {
    const names = pi.session.getAllTools().filter((t) => t.sourceInfo.source !== "builtin").map((t) => t.name).sort();
    assert.deepEqual(names.filter((n) => ["echo", "fails", "hello", "progress", "sleeper"].includes(n)),
      ["echo", "fails", "hello", "progress", "sleeper"]);
    const echo = pi.session.getToolDefinition("echo");
    assert.equal(echo.label, "Echo");
    assert.match(echo.description, /^Echoes its arguments/);
    assert.match(echo.description, /ECHO-DOC-MARKER: the agent reads this body/);
    const props = echo.parameters.properties;
    assert.deepEqual(echo.parameters.required, ["text"]);
    assert.equal(echo.parameters.additionalProperties, false);
    assert.deepEqual({ type: props.mode.type, enum: props.mode.enum, default: props.mode.default }, { type: "string", enum: ["plain", "loud"], default: "plain" });
    assert.equal(props.times.type, "number");
    assert.equal(props.token.writeOnly, true);
    assert.equal(props.text.description, "What to echo.");
    // The user's tool called bash did not replace pi's bash; pi said why.
    assert.notEqual(pi.session.getToolDefinition("bash")?.description, "Not pi's bash.\n\n# bash");
    assert.match(stderr, /skipped the sandboxd tool bash: pi already has a tool of that name/);
    // What the model is shown: the body is in the tool's description.
    let shown;
    pi.faux.setResponses([(context) => {
      shown = context.tools;
      return fauxAssistantMessage("hi");
    }]);
    await pi.session.prompt("which tools?");
    assert.match(shown.find((t) => t.name === "echo").description, /ECHO-DOC-MARKER/);
    // Listing at session start warmed the user's sandbox.
    await waitFor(async () => (await probe.status()).pool.users[USER]?.idle >= 1, "a warm sandbox for the session's user");
  } finally {
    pi.dispose();
    delete process.env.SANDBOXD_USER;
    delete process.env.SANDBOXD_SOCKET;
  }
});

test("one turn calling several tools at once: ids, params and integration env forwarded; details hold no secret", async () => {
  const pi = await bridgeSession();
  try {
    const results = await turn(pi, [
      ["echo", { text: "one", token: "sensitive-arg-77" }, "call_one"],
      ["echo", { text: "two", mode: "loud", times: 2 }, "call_two"],
      ["hello", { name: "pi" }, "call_hello"],
    ]);
    const one = results.get("call_one");
    assert.equal(one.isError, false);
    assert.equal(one.content[0].text, "one");
    const seen = JSON.parse(one.content[1].text);
    assert.equal(seen.toolCallId, "call_one");
    assert.equal(seen.OFFICER_RESOURCES, ENV.OFFICER_RESOURCES);
    assert.equal(seen.PI_SEARXNG_URL, ENV.PI_SEARXNG_URL);
    assert.equal(seen.OFFICER_APIFY_TOKEN, SECRET);
    assert.equal(results.get("call_two").content[0].text, "TWO TWO");
    assert.equal(text(results.get("call_hello")), "Hello, pi!");
    for (const result of results.values()) {
      assert.equal(result.details.status, "ok");
      assert.equal(typeof result.details.durationMs, "number");
      const details = JSON.stringify(result.details);
      assert.ok(!details.includes(SECRET) && !details.includes("sensitive-arg-77"), `details leak a secret: ${details}`);
    }
  } finally {
    pi.dispose();
  }
});

test("a tool's isError reaches pi as an error, with the tool's words", async () => {
  const pi = await bridgeSession();
  try {
    const ends = [];
    const results = await turn(pi, [["fails", {}, "call_fails"], ["echo", { text: "fine" }, "call_fine"]],
      { onEvent: (e) => e.type === "tool_execution_end" && ends.push([e.toolCallId, e.isError]) });
    const failed = results.get("call_fails");
    assert.equal(failed.isError, true);
    assert.match(text(failed), /the quota is exhausted; ask the user to raise it/);
    // Thrown, yet pi's details hold the call's status and duration (set through pi's tool_result hook).
    assert.equal(failed.details.status, "error");
    assert.equal(typeof failed.details.durationMs, "number");
    assert.deepEqual(Object.keys(failed.details).sort(), ["durationMs", "status"]);
    assert.equal(results.get("call_fine").isError, false);
    assert.deepEqual(new Map(ends), new Map([["call_fails", true], ["call_fine", false]]));
  } finally {
    pi.dispose();
  }
});

test("progress from the tool streams into pi's onUpdate", async () => {
  const pi = await bridgeSession();
  try {
    const updates = [];
    const results = await turn(pi, [["progress", { steps: 3 }, "call_progress"]], {
      onEvent: (e) => e.type === "tool_execution_update" && updates.push(e.partialResult),
    });
    assert.deepEqual(updates.map((u) => text(u)), ["step 1", "step 2", "step 3"]);
    assert.deepEqual(updates.map((u) => u.details), [1, 2, 3].map((progress) => ({ status: "running", progress })));
    assert.equal(text(results.get("call_progress")), "did 3 steps");
  } finally {
    pi.dispose();
  }
});

test("aborting pi fires the tool's AbortSignal inside the sandbox, and pi records an error", async () => {
  const pi = await bridgeSession();
  try {
    pi.faux.setResponses([
      fauxAssistantMessage([fauxToolCall("sleeper", { ms: 60000, mark: "pi-abort.txt" }, { id: "call_sleep" })], { stopReason: "toolUse" }),
      fauxAssistantMessage("done"),
    ]);
    const prompt = pi.session.prompt("sleep");
    await waitFor(async () => (await probe.status()).callsInFlight === 1, "the sleeper running in its sandbox");
    await pi.session.abort();
    await prompt;
    const mark = join(daemon.userDir(), "pi-abort.txt");
    await waitFor(() => existsSync(mark), "the tool's abort mark");
    assert.match(readFileSync(mark, "utf8"), /^aborted: /);
    const result = pi.toolResults().get("call_sleep");
    assert.equal(result.isError, true);
    assert.equal(result.details.status, "cancelled");
    await waitFor(async () => (await probe.status()).callsInFlight === 0, "the call answered");
  } finally {
    pi.dispose();
  }
});

test("pi's parallel tool calls really run at the same time in separate sandboxes", async () => {
  const pi = await bridgeSession();
  try {
    const ms = 3000;
    const started = Date.now();
    const results = await turn(pi, [1, 2, 3].map((n) => ["sleeper", { ms }, `call_p${n}`]));
    const wall = Date.now() - started;
    const runs = [...results.values()].map((r) => JSON.parse(text(r)));
    assert.equal(runs.length, 3);
    const latestStart = Math.max(...runs.map((r) => r.started));
    const earliestEnd = Math.min(...runs.map((r) => r.ended));
    assert.ok(latestStart < earliestEnd, `the calls did not overlap: ${JSON.stringify(runs)}`);
    assert.ok(wall < 3 * ms, `three ${ms} ms calls took ${wall} ms: they ran one after another`);
  } finally {
    pi.dispose();
  }
});

test("an input named __proto__ stays an input: required, validated, and passed to the tool", async () => {
  const pi = await bridgeSession();
  try {
    const parameters = pi.session.getToolDefinition("proto_echo").parameters;
    assert.ok(Object.hasOwn(parameters.properties, "__proto__"), "the input is an own property of the schema");
    assert.equal(Object.getPrototypeOf(parameters.properties), Object.prototype);
    assert.deepEqual(parameters.required, ["__proto__"]);
    const args = JSON.parse('{"__proto__": "value"}'); // as a model's tool call arrives: an own key
    const results = await turn(pi, [["proto_echo", args, "call_proto"], ["proto_echo", {}, "call_missing"]]);
    const ok = results.get("call_proto");
    assert.equal(ok.isError, false, text(ok));
    assert.ok(JSON.parse(text(ok)).includes("__proto__"));
    const missing = results.get("call_missing");
    assert.equal(missing.isError, true, "pi let a call without the required input through");
  } finally {
    pi.dispose();
  }
});

test("sandboxd down at session start: pi starts anyway and stderr names sandboxd and the socket", async () => {
  const missing = join(daemon.tmp, "nobody-here.sock");
  process.env.SANDBOXD_USER = USER;
  process.env.SANDBOXD_SOCKET = missing;
  const { value: pi, stderr } = await capturingStderr(() => piSession({ extensionPaths: [PACKAGE_DIR] }));
  try {
    assert.match(stderr, /sandboxd/);
    assert.ok(stderr.includes(missing), `stderr does not name ${missing}: ${stderr}`);
    assert.equal(pi.session.getToolDefinition("echo"), undefined);
    pi.faux.setResponses([fauxAssistantMessage([fauxText("still here")])]);
    await pi.session.prompt("hello?");
    assert.equal(text(pi.session.messages.at(-1)), "still here");
  } finally {
    pi.dispose();
    delete process.env.SANDBOXD_USER;
    delete process.env.SANDBOXD_SOCKET;
  }
});

test("sandboxd restarts between two turns: the second turn's call reconnects and succeeds", async () => {
  const pi = await bridgeSession();
  try {
    assert.equal((await turn(pi, [["echo", { text: "before" }, "call_before"]])).get("call_before").isError, false);
    await daemon.restart();
    const after = (await turn(pi, [["echo", { text: "after" }, "call_after"]])).get("call_after");
    assert.equal(after.isError, false, text(after));
    assert.equal(after.content[0].text, "after");
  } finally {
    pi.dispose();
  }
});
