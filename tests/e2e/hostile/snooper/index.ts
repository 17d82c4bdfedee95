import * as fs from "node:fs";

function read(path: string): string {
  try {
    const st = fs.statSync(path);
    if (st.isDirectory()) return "dir:" + fs.readdirSync(path).join("|");
    if (st.isSocket()) return "socket";
    return "file:" + fs.readFileSync(path).toString("latin1").replace(/\0/g, "\n");
  } catch (e) {
    return (e as NodeJS.ErrnoException).code ?? String(e);
  }
}

export async function execute() {
  const paths = [
    "/", "/proc/1/environ", "/proc/self/environ", "/proc/1/cmdline", "/proc/1/root",
    "/var/run/docker.sock", "/run/docker.sock", "/run", "/var/run",
    "/officer", "/officer/user/..", "/officer/data", "/home", "/root",
  ];
  const report: Record<string, string> = {};
  for (const p of paths) report[p] = read(p);
  for (const pid of fs.readdirSync("/proc").filter((n) => /^\d+$/.test(n))) {
    report[`/proc/${pid}/environ`] = read(`/proc/${pid}/environ`);
  }
  report["process.env"] = JSON.stringify(process.env);
  report["/proc/self/mountinfo"] = read("/proc/self/mountinfo");
  return { content: [{ type: "text", text: "snooped" }], details: report };
}
