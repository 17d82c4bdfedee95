// @sandboxd/pi when sandboxd refuses a call over the user's disk quota (-32004): what the agent reads,
// against a real `sandboxd serve` (soft quota of 1 MiB) and real Docker, then the pure message.

import assert from "node:assert/strict";
import { randomBytes } from "node:crypto";
import { mkdirSync, rmSync, writeFileSync } from "node:fs";
import { join } from "node:path";
import { after, before, test } from "node:test";

import { fauxAssistantMessage, fauxToolCall } from "@mariozechner/pi-ai";
import { QuotaExceededError, SandboxdClient } from "@sandboxd/client";

import { createSandboxdExtension, overQuotaMessage } from "../dist/index.js";
import { startDaemon, USER, waitFor } from "../../testing/daemon.mjs";
import { piSession, text } from "./session.mjs";

const CONFIG = "storage:\n  enforcement: soft\n  quota_bytes: 1m\n  measure_interval_s: 1\npool:\n  shutdown_grace_s: 0.5\n";

let daemon;
let probe; // the test's own view of the daemon

before(async () => {
  daemon = await startDaemon({ config: CONFIG });
  probe = new SandboxdClient({ socketPath: daemon.socket });
});

after(async () => {
  probe?.close();
  await daemon?.dispose();
});

const echo = () => probe.callTool({ user: USER, name: "echo", arguments: { text: "probe" } });

/** One turn whose model calls echo once; the tool result pi gives the model back. */
async function callEcho(pi, id) {
  pi.faux.appendResponses([
    fauxAssistantMessage([fauxToolCall("echo", { text: "hi" }, { id })], { stopReason: "toolUse" }),
    fauxAssistantMessage("done"),
  ]);
  await pi.session.prompt("go");
  return pi.toolResults().get(id);
}

test("over quota, the agent reads what happened, the biggest entries and what it can do; once it deletes, calls run", async () => {
  assert.equal((await echo()).status, "ok"); // the user's folder exists, as after any call
  const cache = join(daemon.userDir(), "cache");
  mkdirSync(cache, { recursive: true });
  writeFileSync(join(cache, "big.bin"), randomBytes(3 << 20)); // random: a compressing filesystem keeps all of it
  // A walk can meet the file half written: wait for the refusal that counts all of it.
  await waitFor(() => echo().then(() => false, (error) => error instanceof QuotaExceededError && error.data?.bytes >= 3 << 20),
    "a refusal over quota that counts the whole file");

  const pi = await piSession({ extensionFactories: [createSandboxdExtension({ user: USER, socketPath: daemon.socket })] });
  try {
    const refused = await callEcho(pi, "call_over");
    assert.equal(refused.isError, true);
    const said = text(refused);
    assert.match(said, /^echo did not run: this user's folders \(\/officer\/user and \/officer\/data\) are over their disk quota, 3\.\d MiB of 1\.0 MiB\./);
    assert.match(said, /The biggest entries: \/officer\/user\/cache \(3\.0 MiB\)/);
    assert.match(said, /delete files that are no longer needed from those folders, then call the tool again/);
    assert.match(said, /tell the user: their sandboxd operator can free space or raise the quota/);
    assert.deepEqual(refused.details, { status: "over_quota" });

    rmSync(join(cache, "big.bin")); // what the agent is told to do
    await waitFor(() => echo().then(() => true, () => false), "calls served again");
    const served = await callEcho(pi, "call_after");
    assert.equal(served.isError, false);
    assert.equal(served.content[0].text, "hi");
  } finally {
    pi.dispose();
  }
});

test("the message says which limit was passed, and keeps the daemon's words when the data does not say", () => {
  const refusal = (data) => new QuotaExceededError(-32004, "alice's folders hold /officer/user/x, which sandboxd cannot read.", data);
  const files = overQuotaMessage("search", refusal({ user: "a", bytes: 10, limitBytes: 1 << 20, inodes: 1200, limitInodes: 1000, biggest: [] }));
  assert.match(files, /^search did not run: .* over their disk quota, 1200 files and folders of 1000\. /);
  assert.doesNotMatch(files, /biggest|sandboxd said/);
  const unreadable = overQuotaMessage("search", refusal({ user: "a", bytes: 10, limitBytes: 1 << 20, inodes: 1, limitInodes: 1000 }));
  assert.match(unreadable, /over their disk quota\. .* sandboxd said: alice's folders hold \/officer\/user\/x, which sandboxd cannot read\.$/);
  const malformed = overQuotaMessage("search", refusal({ bytes: "lots", biggest: "all" }));
  assert.match(malformed, /sandboxd said: alice's folders/);
  const bigger = overQuotaMessage("search", refusal({ bytes: 3 * 2 ** 30, limitBytes: 2 ** 30, inodes: 1, limitInodes: 9,
    biggest: [{ path: "/officer/data/a", bytes: 2 * 2 ** 30 }, { path: 7 }, { path: "/officer/user/b", bytes: 900 }] }));
  assert.match(bigger, /3\.0 GiB of 1\.0 GiB\. .* The biggest entries: \/officer\/data\/a \(2\.0 GiB\), \/officer\/user\/b \(900 B\)\./);
});
