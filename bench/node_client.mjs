// Warm hello calls through @sandboxd/client, the way pi (clients/pi) makes them:
// `node bench/node_client.mjs SOCKET USER COUNT WARMUP` prints {"seconds": [...]} (one sample per call).
// The client comes from clients/typescript/dist (`make clients`).

import { SandboxdClient } from "../clients/typescript/dist/index.js";

const [socketPath, user, count, warmup] = process.argv.slice(2);
if (!socketPath || !user || !count) {
  console.error("usage: node bench/node_client.mjs SOCKET USER COUNT [WARMUP]");
  process.exit(2);
}

const client = new SandboxdClient({ socketPath });
const call = async () => {
  const result = await client.callTool({ user, name: "hello", arguments: { name: "World" } });
  if (result.status !== "ok") throw new Error(`hello did not succeed: ${JSON.stringify(result).slice(0, 400)}`);
};

try {
  for (let i = 0; i < Number(warmup ?? 500); i++) await call(); // JIT and the sandbox's tool cache
  const seconds = new Array(Number(count));
  for (let i = 0; i < seconds.length; i++) {
    const started = process.hrtime.bigint();
    await call();
    seconds[i] = Number(process.hrtime.bigint() - started) / 1e9;
  }
  process.stdout.write(JSON.stringify({ seconds }));
} finally {
  client.close();
}
