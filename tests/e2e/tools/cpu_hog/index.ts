import { readFileSync } from "node:fs";
import { Worker } from "node:worker_threads";

// cgroup v1 (the engine's), else v2: nanoseconds of CPU the whole sandbox used.
function usageNs(): number {
  try {
    return Number(readFileSync("/sys/fs/cgroup/cpuacct/cpuacct.usage", "utf8"));
  } catch {
    const line = readFileSync("/sys/fs/cgroup/cpu.stat", "utf8").split("\n").find((l) => l.startsWith("usage_usec"));
    return Number(line!.split(" ")[1]) * 1000;
  }
}

export async function execute(_id: string, params: { ms: number; threads: number }) {
  const code = `const end = Date.now() + ${params.ms}; while (Date.now() < end) {}`;
  const before = usageNs();
  const started = process.hrtime.bigint();
  await Promise.all(Array.from({ length: params.threads }, () => new Promise((resolve, reject) => {
    const worker = new Worker(code, { eval: true });
    worker.on("exit", resolve);
    worker.on("error", reject);
  })));
  const wallNs = Number(process.hrtime.bigint() - started);
  const cores = (usageNs() - before) / wallNs;
  return { content: [{ type: "text", text: `used ${cores.toFixed(2)} cores` }], details: { cores, wallMs: wallNs / 1e6 } };
}
