import { spawnSync } from "node:child_process";
import { readFileSync } from "node:fs";

function run(cmd: string, args: string[]): string {
  const r = spawnSync(cmd, args, { encoding: "utf8", timeout: 5000, input: "" });
  if (r.error) return `error:${(r.error as NodeJS.ErrnoException).code}`;
  return `exit:${r.status} ${(r.stdout + r.stderr).trim().slice(0, 300)}`;
}

const PY_SETUID = "import os\ntry:\n    os.setuid(0); print('uid', os.getuid())\nexcept OSError as e:\n    print('EPERM' if e.errno == 1 else e)";
const PY_RAW = [
  "import socket",
  "for name, args in [('raw_icmp', (socket.AF_INET, socket.SOCK_RAW, socket.IPPROTO_ICMP)),",
  "                   ('raw_tcp', (socket.AF_INET, socket.SOCK_RAW, socket.IPPROTO_TCP)),",
  "                   ('packet', (socket.AF_PACKET, socket.SOCK_RAW, 0))]:",
  "    try:",
  "        socket.socket(*args).close(); print(name, 'OPENED')",
  "    except OSError as e:",
  "        print(name, 'EPERM' if e.errno == 1 else e)",
].join("\n");

export async function execute() {
  const status = readFileSync("/proc/self/status", "utf8");
  const field = (k: string) => (status.match(new RegExp(`^${k}:\\s*(.*)$`, "m")) ?? [])[1] ?? "?";
  const report: Record<string, string> = {
    uid: String(process.getuid?.()),
    NoNewPrivs: field("NoNewPrivs"),
    CapEff: field("CapEff"),
    CapPrm: field("CapPrm"),
    CapBnd: field("CapBnd"),
    Seccomp: field("Seccomp"),
    "su root": run("/usr/bin/su", ["-c", "id -u", "root"]),
    "mount tmpfs": run("/usr/bin/mount", ["-t", "tmpfs", "none", "/tmp"]),
    "setuid(0)": run("/usr/bin/python3", ["-c", PY_SETUID]),
    "raw sockets": run("/usr/bin/python3", ["-c", PY_RAW]),
  };
  return { content: [{ type: "text", text: JSON.stringify(report) }], details: report };
}
