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

// Periods in which the sandbox's CPU quota ran out and its threads were held back.
function throttledPeriods(): number {
  for (const file of ["/sys/fs/cgroup/cpu/cpu.stat", "/sys/fs/cgroup/cpu.stat"]) {
    try {
      const line = readFileSync(file, "utf8").split("\n").find((l) => l.startsWith("nr_throttled"));
      if (line) return Number(line.split(" ")[1]);
    } catch { /* the other cgroup version */ }
  }
  return -1;
}

export async function execute(_id: string, params: { ms: number; threads: number }) {
  const code = `const end = Date.now() + ${params.ms}; while (Date.now() < end) {}`;
  const before = usageNs();
  const throttledBefore = throttledPeriods();
  const started = process.hrtime.bigint();
  await Promise.all(Array.from({ length: params.threads }, () => new Promise((resolve, reject) => {
    const worker = new Worker(code, { eval: true });
    worker.on("exit", resolve);
    worker.on("error", reject);
  })));
  const wallNs = Number(process.hrtime.bigint() - started);
  const cores = (usageNs() - before) / wallNs;
  const throttled = throttledPeriods() - throttledBefore;
  return { content: [{ type: "text", text: `used ${cores.toFixed(2)} cores` }],
           details: { cores, throttled, wallMs: wallNs / 1e6 } };
}
