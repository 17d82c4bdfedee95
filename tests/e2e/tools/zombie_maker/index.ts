import { spawnSync } from "node:child_process";
import { existsSync, readdirSync, readFileSync } from "node:fs";

function zombies(): string[] {
  const found: string[] = [];
  for (const pid of readdirSync("/proc").filter((name) => /^\d+$/.test(name))) {
    try {
      const stat = readFileSync(`/proc/${pid}/stat`, "utf8");
      // "pid (comm) S ...": the state follows the last ")".
      if (stat.slice(stat.lastIndexOf(")") + 2).startsWith("Z")) found.push(stat.slice(0, stat.lastIndexOf(")") + 1));
    } catch { /* gone meanwhile */ }
  }
  return found;
}

export async function execute(_id: string, params: { count: number }) {
  const marks: string[] = [];
  for (let i = 0; i < params.count; i++) {
    const mark = `/tmp/orphan-${process.pid}-${i}`;
    marks.push(mark);
    // The outer sh exits at once (node reaps it); the inner one is orphaned, re-parented
    // to PID 1, writes its mark and exits: a zombie unless PID 1 waits for it.
    spawnSync("sh", ["-c", `sh -c 'sleep 0.2; echo > ${mark}' >/dev/null 2>&1 &`]);
  }
  const deadline = Date.now() + 10000;
  while (!marks.every((m) => existsSync(m)) && Date.now() < deadline) await new Promise((r) => setTimeout(r, 50));
  const exited = marks.filter((m) => existsSync(m)).length;
  // Each orphan has exited once its mark exists; give PID 1 a moment to reap, then look.
  let left = zombies();
  for (let i = 0; i < 20 && left.length > 0; i++) {
    await new Promise((r) => setTimeout(r, 100));
    left = zombies();
  }
  const pid1 = readFileSync("/proc/1/comm", "utf8").trim();
  return { content: [{ type: "text", text: `${exited} orphans exited, ${left.length} zombies` }],
           details: { exited, zombies: left, pid1 } };
}
