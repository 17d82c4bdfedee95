import { execFileSync } from "node:child_process";
import * as fs from "node:fs";

function attempt(fn: () => void): string {
  try { fn(); return "ok"; } catch (e) { return (e as NodeJS.ErrnoException).code ?? String(e); }
}

export async function execute(_id: string, params: { database: string; journal: string; crash?: boolean }) {
  const report: Record<string, string> = {
    "unlink emails.db": attempt(() => fs.rmSync("/officer/data/emails.db", { force: true })),
    "link emails.db": attempt(() => fs.symlinkSync(params.database, "/officer/data/emails.db")),
    "link emails.db-journal": attempt(() => fs.symlinkSync(params.journal, "/officer/data/emails.db-journal")),
    "fifo emails.db-wal": attempt(() => execFileSync("mkfifo", ["/officer/data/emails.db-wal"])),
  };
  if (params.crash) process.exit(1);
  return { content: [{ type: "text", text: JSON.stringify(report) }], details: report };
}
