// examples/embed.mjs, the embedding the README points to, runs as shipped: pi's SDK with the
// faux model, @sandboxd/pi by its package name, against a real `sandboxd serve` and Docker.

import assert from "node:assert/strict";
import { execFile } from "node:child_process";
import { join } from "node:path";
import { after, before, test } from "node:test";
import { promisify } from "node:util";

import { startDaemon, USER } from "../../testing/daemon.mjs";
import { PACKAGE_DIR } from "./session.mjs";

const run = promisify(execFile);
let daemon;

before(async () => {
  daemon = await startDaemon();
});

after(async () => {
  await daemon?.dispose();
});

test("the example embedding lists the user's tools, calls hello through the faux model and prints the answer", async () => {
  const { stdout, stderr } = await run(process.execPath, [join(PACKAGE_DIR, "examples", "embed.mjs"), USER], {
    cwd: PACKAGE_DIR,
    env: { ...process.env, SANDBOXD_SOCKET: daemon.socket },
    timeout: 60_000,
  });
  assert.match(stdout, new RegExp(`^tools of ${USER}: .*\\bhello\\b`, "m"), stdout + stderr);
  assert.match(stdout, /^hello → Hello, pi! \(\{"status":"ok","durationMs":\d+\}\)$/m, stdout + stderr);
  assert.match(stdout, /^model: Greeted\.$/m);
});

test("the example says how to call it when no user is given", async () => {
  const env = { ...process.env };
  delete env.SANDBOXD_USER;
  await assert.rejects(run(process.execPath, [join(PACKAGE_DIR, "examples", "embed.mjs")], { cwd: PACKAGE_DIR, env }),
    (error) => error.code === 2 && /usage: node examples\/embed\.mjs USER/.test(error.stderr));
});
