// `sandboxd mcp` with the TypeScript MCP SDK's client (what Claude Desktop, Cursor, VS Code and
// most hosts are built on), over stdio and streamable HTTP, against a real daemon and Docker.

import assert from "node:assert/strict";
import { existsSync, readFileSync } from "node:fs";
import net from "node:net";
import { join } from "node:path";
import { after, before, test } from "node:test";

import { Client } from "@modelcontextprotocol/sdk/client/index.js";
import { StdioClientTransport } from "@modelcontextprotocol/sdk/client/stdio.js";
import { StreamableHTTPClientTransport } from "@modelcontextprotocol/sdk/client/streamableHttp.js";
import { McpError, ToolListChangedNotificationSchema } from "@modelcontextprotocol/sdk/types.js";
import { spawn } from "node:child_process";

import { Daemon, REPO, startDaemon, waitFor } from "../../testing/daemon.mjs";
import { PYTHON, USER, mcpArgs, serverEnv, text, tickerTool } from "./server.mjs";

const TOKEN = "token-for-the-typescript-sdk-tests-0123456789";
let daemon;

before(async () => {
  daemon = await startDaemon({ config: "pool:\n  shutdown_grace_s: 0.5\ncalls:\n  allowed_env: [OFFICER_APIFY_TOKEN]\n" });
  tickerTool(daemon.userDir());
});

after(async () => {
  await daemon?.dispose();
});

async function stdioClient(extra = {}) {
  const transport = new StdioClientTransport({
    command: PYTHON, args: mcpArgs(daemon), cwd: REPO, stderr: "pipe",
    env: serverEnv({ OFFICER_APIFY_TOKEN: "apify-from-the-host-config", ...extra }),
  });
  const client = new Client({ name: "sandboxd-tests", version: "1.0.0" });
  await client.connect(transport);
  return client;
}

async function freePort() {
  const server = net.createServer();
  await new Promise((resolve) => server.listen(0, "127.0.0.1", resolve));
  const { port } = server.address();
  await new Promise((resolve) => server.close(resolve));
  return port;
}

async function httpServer() {
  const port = await freePort();
  const proc = spawn(PYTHON, mcpArgs(daemon, "--http", `127.0.0.1:${port}`), {
    cwd: REPO, stdio: ["ignore", "ignore", "pipe"], env: serverEnv({ SANDBOXD_MCP_TOKEN: TOKEN }),
  });
  let stderr = "";
  proc.stderr.on("data", (d) => { stderr += d; });
  await waitFor(() => new Promise((resolve) => {
    const socket = net.createConnection({ port, host: "127.0.0.1" });
    socket.on("connect", () => { socket.destroy(); resolve(true); });
    socket.on("error", () => resolve(proc.exitCode !== null ? Promise.reject(new Error(stderr)) : false));
  }), "sandboxd mcp --http to listen");
  return { url: new URL(`http://127.0.0.1:${port}/mcp`), stop: () => proc.kill("SIGTERM") };
}

/** What every transport must do: list, call, isError, progress, cancel, an unknown tool. */
async function theBasics(client, mark) {
  const { tools } = await client.listTools();
  const byName = new Map(tools.map((t) => [t.name, t]));
  assert.equal(byName.get("echo").title, "Echo");
  assert.match(byName.get("echo").description, /^Echoes its arguments/);
  assert.deepEqual(byName.get("echo").inputSchema.required, ["text"]);

  const echoed = await client.callTool({ name: "echo", arguments: { text: "hi", mode: "loud" } });
  assert.equal(echoed.isError, false);
  assert.equal(echoed.content[0].text, "HI");
  assert.equal(JSON.parse(echoed.content[1].text).OFFICER_APIFY_TOKEN, "apify-from-the-host-config");

  const failed = await client.callTool({ name: "fails", arguments: {} });
  assert.equal(failed.isError, true);
  assert.match(text(failed), /quota is exhausted/);
  assert.equal(failed._meta["sandboxd/status"], "error");

  const updates = [];
  const progress = await client.callTool({ name: "ticker", arguments: { steps: 3 } }, undefined,
    { onprogress: (p) => updates.push([p.progress, p.message]) });
  assert.equal(text(progress), "ticked 3 times");
  assert.deepEqual(updates, [[1, "tick 1"], [2, "tick 2"], [3, "tick 3"]]);

  const controller = new AbortController();
  const cancelled = client.callTool({ name: "sleeper", arguments: { ms: 30000, mark } }, undefined,
    { signal: controller.signal });
  setTimeout(() => controller.abort("the user pressed stop"), 1000);
  await assert.rejects(cancelled, /the user pressed stop/);
  const marker = join(daemon.userDir(), mark);
  await waitFor(() => existsSync(marker), "the AbortSignal to fire in the sandbox", 10_000);
  assert.match(readFileSync(marker, "utf8"), /cancelled by the MCP client/);

  await assert.rejects(client.callTool({ name: "no_such_tool", arguments: {} }), (error) => {
    assert.ok(error instanceof McpError);
    assert.equal(error.code, -32602);
    assert.match(error.message, /unknown tool 'no_such_tool'/);
    return true;
  });
}

test("stdio: list, call, isError, progress, cancel, an unknown tool", async () => {
  const client = await stdioClient();
  try {
    await theBasics(client, "aborted-stdio");
  } finally {
    await client.close();
  }
});

test("streamable HTTP with the bearer token: the same", async () => {
  const server = await httpServer();
  const client = new Client({ name: "sandboxd-tests", version: "1.0.0" });
  try {
    await client.connect(new StreamableHTTPClientTransport(server.url, {
      requestInit: { headers: { Authorization: `Bearer ${TOKEN}` } },
    }));
    // The env of the HTTP server's own environment: none was set for it.
    const { tools } = await client.listTools();
    assert.ok(tools.some((t) => t.name === "echo"));
    const failed = await client.callTool({ name: "fails", arguments: {} });
    assert.equal(failed.isError, true);
    const updates = [];
    await client.callTool({ name: "ticker", arguments: { steps: 2 } }, undefined, { onprogress: (p) => updates.push(p.progress) });
    assert.deepEqual(updates, [1, 2]);
    const controller = new AbortController();
    const cancelled = client.callTool({ name: "sleeper", arguments: { ms: 30000, mark: "aborted-http" } }, undefined,
      { signal: controller.signal });
    setTimeout(() => controller.abort(), 1000);
    await assert.rejects(cancelled);
    await waitFor(() => existsSync(join(daemon.userDir(), "aborted-http")), "the AbortSignal over HTTP", 10_000);
    await assert.rejects(client.callTool({ name: "no_such_tool", arguments: {} }), /unknown tool/);
    const refused = new Client({ name: "no-token", version: "1.0.0" });
    await assert.rejects(refused.connect(new StreamableHTTPClientTransport(server.url)), /Authorization: Bearer/);
  } finally {
    await client.close();
    server.stop();
  }
});

test("list_changed reaches the client when a tool is added to the user's folder", async () => {
  const client = await stdioClient();
  try {
    let changed = 0;
    client.setNotificationHandler(ToolListChangedNotificationSchema, () => { changed += 1; });
    assert.ok(!(await client.listTools()).tools.some((t) => t.name === "fresh"));
    const { mkdirSync, writeFileSync } = await import("node:fs");
    const dir = join(daemon.userDir(), "tools", "fresh");
    mkdirSync(dir, { recursive: true });
    writeFileSync(join(dir, "TOOL.md"), "---\nname: fresh\ndescription: Just added.\nversion: 1\n---\n# fresh\n");
    writeFileSync(join(dir, "index.ts"), "export async function execute() { return { content: [] }; }\n");
    await waitFor(() => changed > 0, "notifications/tools/list_changed", 10_000);
    assert.ok((await client.listTools()).tools.some((t) => t.name === "fresh"));
  } finally {
    await client.close();
  }
});

test("a daemon that is down: a clear error at start, not a hang", async () => {
  const down = new Daemon(); // never started: nothing listens on its socket
  const transport = new StdioClientTransport({ command: PYTHON, args: mcpArgs(down), cwd: REPO, stderr: "pipe", env: serverEnv() });
  let stderr = "";
  transport.stderr.on("data", (d) => { stderr += d; });
  const client = new Client({ name: "sandboxd-tests", version: "1.0.0" });
  const started = Date.now();
  await assert.rejects(client.connect(transport), /closed/i);
  assert.ok(Date.now() - started < 15_000);
  await waitFor(() => stderr.includes("no sandboxd is listening on"), "the reason on stderr", 5000);
});

test("the daemon restarted mid-session: the next call reconnects", async () => {
  const client = await stdioClient();
  try {
    assert.equal((await client.callTool({ name: "echo", arguments: { text: "before" } })).content[0].text, "before");
    await daemon.restart();
    assert.equal((await client.callTool({ name: "echo", arguments: { text: "after" } })).content[0].text, "after");
  } finally {
    await client.close();
  }
});
