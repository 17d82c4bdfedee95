// pi with pi-mcp-adapter (npm), its tools registered directly (`directTools`), pi-ai's faux model
// calling them: `sandboxd mcp` over stdio, a real daemon and Docker.

import assert from "node:assert/strict";
import { existsSync, readFileSync, rmSync } from "node:fs";
import { join } from "node:path";
import { after, before, test } from "node:test";

import { fauxAssistantMessage, fauxToolCall } from "@earendil-works/pi-ai";

import { Daemon, REPO, startDaemon, waitFor } from "../../testing/daemon.mjs";
import { piSession } from "./pi-session.mjs";
import { PYTHON, mcpArgs, text, tickerTool } from "./server.mjs";

let daemon;

before(async () => {
  daemon = await startDaemon({ config: "pool:\n  shutdown_grace_s: 0.5\n" });
  tickerTool(daemon.userDir());
});

after(async () => {
  await daemon?.dispose();
});

/** The `.mcp.json` a pi user writes: the three lines, plus the adapter's own settings. */
function mcpConfig(target = daemon, settings = {}) {
  return {
    settings: { toolPrefix: "server", ...settings },
    mcpServers: {
      sandboxd: {
        command: PYTHON, args: mcpArgs(target), cwd: REPO,
        directTools: true, lifecycle: "eager", requestTimeoutMs: 120_000,
      },
    },
  };
}

async function toolNames(pi) {
  return pi.session.getActiveToolNames();
}

async function session(config = mcpConfig()) {
  const pi = await piSession(config);
  await waitFor(async () => (await toolNames(pi)).includes("sandboxd_echo"), "pi-mcp-adapter to register the tools");
  return pi;
}

/** One prompt whose first model turn makes `calls`, then ends; the tool results by call id. */
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

test("the faux model calls sandboxed tools through the adapter: a result, isError, a long tool", async () => {
  const pi = await session();
  try {
    const tools = new Map(pi.session.getAllTools().map((t) => [t.name, t]));
    assert.match(tools.get("sandboxd_echo").description, /Echoes its arguments/);
    const results = await turn(pi, [
      ["sandboxd_echo", { text: "through pi", mode: "loud" }, "call_echo"],
      ["sandboxd_fails", {}, "call_fails"],
      ["sandboxd_ticker", { steps: 3 }, "call_ticker"],
    ]);
    assert.equal(results.get("call_echo").isError, false);
    assert.match(text(results.get("call_echo")), /^THROUGH PI/);
    assert.equal(results.get("call_fails").isError, true);
    assert.match(text(results.get("call_fails")), /the quota is exhausted/);
    assert.equal(text(results.get("call_ticker")), "ticked 3 times");
  } finally {
    await pi.dispose();
  }
});

test("aborting pi fires the tool's AbortSignal inside the sandbox", async () => {
  const pi = await session();
  try {
    pi.faux.setResponses([
      fauxAssistantMessage([fauxToolCall("sandboxd_sleeper", { ms: 60000, mark: "pi-mcp-abort.txt" }, { id: "call_sleep" })],
        { stopReason: "toolUse" }),
      fauxAssistantMessage("done"),
    ]);
    const prompt = pi.session.prompt("sleep");
    await new Promise((r) => setTimeout(r, 2000));
    await pi.session.abort();
    await prompt;
    const mark = join(daemon.userDir(), "pi-mcp-abort.txt");
    await waitFor(() => existsSync(mark), "the tool's abort mark", 10_000);
    assert.match(readFileSync(mark, "utf8"), /cancelled by the MCP client/);
  } finally {
    await pi.dispose();
  }
});

test("a tool gone since it was listed: the daemon's 'unknown tool' reaches the model as an error", async () => {
  const pi = await session(mcpConfig(daemon, { freezeDirectTools: true }));
  const ticker = join(daemon.userDir(), "tools", "ticker");
  try {
    rmSync(ticker, { recursive: true, force: true });
    const results = await turn(pi, [["sandboxd_ticker", { steps: 1 }, "call_gone"]]);
    assert.equal(results.get("call_gone").isError, true);
    assert.match(text(results.get("call_gone")), /unknown tool 'ticker'/);
  } finally {
    tickerTool(daemon.userDir());
    await pi.dispose();
  }
});

test("the daemon restarted mid-session: the next call reconnects", async () => {
  const pi = await session();
  try {
    assert.match(text((await turn(pi, [["sandboxd_echo", { text: "before" }, "call_before"]])).get("call_before")), /^before/);
    await daemon.restart();
    assert.match(text((await turn(pi, [["sandboxd_echo", { text: "after" }, "call_after"]])).get("call_after")), /^after/);
  } finally {
    await pi.dispose();
  }
});

test("a daemon that is down: pi starts without the tools, at once, and says why", async () => {
  const down = new Daemon(); // never started
  const said = capturingOutput();
  const started = Date.now();
  const pi = await piSession(mcpConfig(down));
  try {
    await waitFor(() => said.text().includes("no sandboxd is listening on"), "the adapter to report sandboxd's reason", 15_000);
    assert.ok(Date.now() - started < 20_000);
    assert.ok(!(await toolNames(pi)).some((name) => name.startsWith("sandboxd_")));
  } finally {
    said.restore();
    await pi.dispose();
  }
});

/** What this process writes to stdout and stderr from now on (still written through). */
function capturingOutput() {
  const chunks = [];
  const originals = [process.stdout.write, process.stderr.write];
  for (const stream of [process.stdout, process.stderr]) {
    const write = stream.write;
    stream.write = (chunk, ...rest) => {
      chunks.push(String(chunk));
      return write.call(stream, chunk, ...rest);
    };
  }
  return {
    text: () => chunks.join(""),
    restore() {
      [process.stdout.write, process.stderr.write] = originals;
    },
  };
}
