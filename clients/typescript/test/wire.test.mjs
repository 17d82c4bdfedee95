// The client against a scripted socket server: framing, deadlines, typed errors.
// (client.test.mjs runs the same client against the real daemon.)

import assert from "node:assert/strict";
import { mkdtempSync, rmSync } from "node:fs";
import net from "node:net";
import { tmpdir } from "node:os";
import { join } from "node:path";
import { after, test } from "node:test";

import {
  BackendUnavailableError,
  ConnectionLostError,
  DaemonUnreachableError,
  DEFAULT_SOCKET,
  DeadlineExceededError,
  InternalError,
  InvalidParamsError,
  OverloadedError,
  PeerRefusedError,
  QuotaExceededError,
  resolveSocketPath,
  SandboxdClient,
  SandboxdError,
} from "../dist/index.js";

const dirs = [];
after(() => dirs.forEach((dir) => rmSync(dir, { recursive: true, force: true })));

/** A server that hands each parsed message to `onMessage(message, socket)`. */
async function scripted(onMessage, onConnect = () => {}) {
  const dir = mkdtempSync(join(tmpdir(), "sbd-wire-"));
  dirs.push(dir);
  const path = join(dir, "s.sock");
  const received = [];
  const sockets = new Set();
  const server = net.createServer((socket) => {
    sockets.add(socket);
    onConnect(socket);
    let buffer = "";
    socket.on("error", () => {});
    socket.on("data", (data) => {
      buffer += data;
      let end;
      while ((end = buffer.indexOf("\n")) >= 0) {
        const message = JSON.parse(buffer.slice(0, end));
        buffer = buffer.slice(end + 1);
        received.push(message);
        onMessage(message, socket);
      }
    });
  });
  await new Promise((resolve) => server.listen(path, resolve));
  return {
    path,
    received,
    close: () => new Promise((resolve) => {
      sockets.forEach((s) => s.destroy());
      server.close(resolve);
    }),
  };
}

const reply = (socket, message) => socket.write(JSON.stringify({ jsonrpc: "2.0", ...message }) + "\n");

test("the socket comes from the options, else SANDBOXD_SOCKET, else the default", () => {
  assert.equal(resolveSocketPath("/a.sock", { SANDBOXD_SOCKET: "/b.sock" }), "/a.sock");
  assert.equal(resolveSocketPath(undefined, { SANDBOXD_SOCKET: "/b.sock" }), "/b.sock");
  assert.equal(resolveSocketPath(undefined, {}), DEFAULT_SOCKET);
  assert.equal(DEFAULT_SOCKET, "/run/sandboxd/sandboxd.sock");
  assert.equal(new SandboxdClient({ env: { SANDBOXD_SOCKET: "/c.sock" } }).socketPath, "/c.sock");
});

test("lines split anywhere, even inside a UTF-8 character, with \\r\\n and answers out of order", async () => {
  const server = await scripted((message, socket) => {
    if (message.id === 1) return; // answered after the second
    const second = JSON.stringify({ jsonrpc: "2.0", id: 2, result: { text: "zwei \u2028 ü" } }) + "\r\n";
    const first = JSON.stringify({ jsonrpc: "2.0", id: 1, result: { text: "eins ü" } }) + "\n";
    const bytes = Buffer.from(second + first);
    const cut = bytes.indexOf(Buffer.from("ü")) + 1; // in the middle of the two bytes of ü
    socket.write(bytes.subarray(0, cut));
    setTimeout(() => socket.write(bytes.subarray(cut)), 20);
  });
  const client = new SandboxdClient({ socketPath: server.path });
  const [one, two] = await Promise.all([client.request("ping"), client.request("ping")]);
  assert.deepEqual(one, { text: "eins ü" });
  assert.deepEqual(two, { text: "zwei \u2028 ü" });
  client.close();
  await server.close();
});

test("error codes become typed errors; overloaded is retryable", async () => {
  const codes = { 1: -32602, 2: -32001, 3: -32002, 4: -32603, 5: -32003, 6: -32004 };
  const server = await scripted((message, socket) =>
    reply(socket, { id: message.id, error: { code: codes[message.id], message: `failure ${message.id}`, data: { n: message.id } } }));
  const client = new SandboxdClient({ socketPath: server.path });
  const outcomes = await Promise.allSettled([1, 2, 3, 4, 5, 6].map(() => client.request("ping")));
  const errors = outcomes.map((o) => o.reason);
  assert.ok(errors[0] instanceof InvalidParamsError);
  assert.ok(errors[1] instanceof OverloadedError);
  assert.ok(errors[2] instanceof BackendUnavailableError);
  assert.ok(errors[3] instanceof InternalError);
  assert.ok(errors[4] instanceof PeerRefusedError);
  assert.ok(errors[5] instanceof QuotaExceededError);
  assert.deepEqual(errors.map((e) => e.code), [-32602, -32001, -32002, -32603, -32003, -32004]);
  assert.deepEqual(errors.map((e) => e.retryable), [false, true, false, false, false, false]);
  assert.equal(errors[0].message, "failure 1");
  assert.deepEqual(errors[0].data, { n: 1 });
  assert.ok(errors.every((e) => e instanceof SandboxdError));
  client.close();
  await server.close();
});

test("a daemon that never answers: the call fails at its timeout plus grace, and is cancelled", { timeout: 20_000 }, async () => {
  const server = await scripted(() => {});
  const client = new SandboxdClient({ socketPath: server.path, deadlineGraceMs: 200 });
  const started = Date.now();
  await assert.rejects(
    client.callTool({ user: "a@x.io", name: "hello", arguments: {}, timeoutMs: 100 }),
    (error) => error instanceof DeadlineExceededError && error.deadlineMs === 300 && /within 300 ms/.test(error.message),
  );
  const elapsed = Date.now() - started;
  assert.ok(elapsed >= 290 && elapsed < 5000, `answered after ${elapsed} ms`);
  const call = server.received.find((m) => m.method === "tools/call");
  assert.equal(call.params.timeoutMs, 100);
  await waitUntil(() => server.received.some((m) => m.method === "notifications/cancelled"));
  const cancel = server.received.find((m) => m.method === "notifications/cancelled");
  assert.equal(cancel.params.requestId, call.id);
  assert.equal("id" in cancel, false);
  client.close();
  await server.close();
});

test("a call with no timeoutMs sends the client's default, and its deadline follows it", async () => {
  const server = await scripted(() => {});
  const client = new SandboxdClient({ socketPath: server.path, defaultTimeoutMs: 150, deadlineGraceMs: 50 });
  await assert.rejects(client.callTool({ user: "a@x.io", name: "hello" }), DeadlineExceededError);
  assert.equal(server.received[0].params.timeoutMs, 150);
  assert.deepEqual(server.received[0].params.arguments, {});
  client.close();
  await server.close();
});

test("aborting sends notifications/cancelled and waits for the daemon's cancelled answer", async () => {
  const server = await scripted((message, socket) => {
    if (message.method === "notifications/cancelled") {
      reply(socket, { id: message.params.requestId, result: { status: "cancelled", isError: true, content: [], durationMs: 5 } });
    }
  });
  const client = new SandboxdClient({ socketPath: server.path });
  const controller = new AbortController();
  const call = client.callTool({ user: "a@x.io", name: "sleeper", arguments: { ms: 60000 } }, { signal: controller.signal });
  await waitUntil(() => server.received.length === 1);
  controller.abort(new Error("the user pressed escape"));
  const result = await call;
  assert.equal(result.status, "cancelled");
  assert.equal(server.received[1].params.reason, "the user pressed escape");
  // Already aborted: nothing is sent at all.
  await assert.rejects(client.callTool({ user: "a@x.io", name: "x" }, { signal: controller.signal }), { name: "AbortError" });
  assert.equal(server.received.length, 2);
  client.close();
  await server.close();
});

test("progress reaches the call it belongs to, in order, before its result", async () => {
  const server = await scripted((message, socket) => {
    const token = message.params._meta.progressToken;
    for (let i = 1; i <= 3; i++) {
      socket.write(JSON.stringify({ jsonrpc: "2.0", method: "notifications/progress",
        params: { progressToken: token, progress: i, content: [{ type: "text", text: `${message.params.name} ${i}` }] } }) + "\n");
    }
    reply(socket, { id: message.id, result: { status: "ok", isError: false, content: [], durationMs: 1 } });
  });
  const client = new SandboxdClient({ socketPath: server.path });
  const seen = { a: [], b: [] };
  await Promise.all(["a", "b"].map((name) =>
    client.callTool({ user: "a@x.io", name }, { onProgress: (p) => seen[name].push(`${p.progress}:${p.content[0].text}`) })));
  assert.deepEqual(seen, { a: ["1:a 1", "2:a 2", "3:a 3"], b: ["1:b 1", "2:b 2", "3:b 3"] });
  client.close();
  await server.close();
});

test("a refused peer gets PeerRefusedError, not a bare disconnect", async () => {
  const server = await scripted(() => {}, (socket) => {
    socket.end(JSON.stringify({ jsonrpc: "2.0", id: null, error: { code: -32003, message: "uid 1234 is not allowed" } }) + "\n");
  });
  const client = new SandboxdClient({ socketPath: server.path });
  await assert.rejects(client.ping(), (e) => e instanceof PeerRefusedError && /uid 1234/.test(e.message));
  client.close();
  await server.close();
});

test("a dropped connection fails every request in flight, and the next request reconnects", async () => {
  let connections = 0;
  const server = await scripted((message, socket) => {
    if (connections === 1) socket.destroy(); // the first connection dies with both calls unanswered
    else reply(socket, { id: message.id, result: {} });
  }, () => connections++);
  const client = new SandboxdClient({ socketPath: server.path });
  const outcomes = await Promise.allSettled([client.request("ping"), client.request("ping")]);
  for (const outcome of outcomes) {
    assert.equal(outcome.status, "rejected");
    assert.ok(outcome.reason instanceof ConnectionLostError);
    assert.match(outcome.reason.message, /closed with this request in flight/);
  }
  assert.deepEqual(await client.request("ping"), {});
  assert.equal(connections, 2);
  client.close();
  await server.close();
});

test("no daemon: DaemonUnreachableError names the socket and how to start one", async () => {
  const dir = mkdtempSync(join(tmpdir(), "sbd-wire-"));
  dirs.push(dir);
  const path = join(dir, "missing.sock");
  const client = new SandboxdClient({ socketPath: path });
  await assert.rejects(client.listTools(), (e) =>
    e instanceof DaemonUnreachableError && e.socketPath === path && e.message.includes(path) && /sandboxd serve/.test(e.message));
  client.close();
});

test("an oversized request is refused before it is sent", async () => {
  const server = await scripted(() => {});
  const client = new SandboxdClient({ socketPath: server.path, maxMessageBytes: 1024 });
  await assert.rejects(client.callTool({ user: "a@x.io", name: "echo", arguments: { text: "x".repeat(2000) } }), /over the daemon's limit/);
  assert.equal(server.received.length, 0);
  client.close();
  await server.close();
});

async function waitUntil(check, timeoutMs = 5000) {
  const deadline = Date.now() + timeoutMs;
  while (!check()) {
    if (Date.now() > deadline) throw new Error("timed out waiting");
    await new Promise((r) => setTimeout(r, 10));
  }
}
