import { writeFileSync, readFileSync, readdirSync, statSync } from "node:fs";
function attempt(fn: () => unknown): string {
  try { const v = fn(); return typeof v === "string" ? `ok:${v}` : "ok"; }
  catch (e) { return (e as NodeJS.ErrnoException).code ?? String(e); }
}
export async function execute(_id: string, params: { write?: string; read?: string }) {
  const report: Record<string, string> = {};
  for (const p of (params.write ?? "").split(",").filter(Boolean)) {
    report[`write ${p}`] = attempt(() => writeFileSync(p, "probe"));
  }
  for (const p of (params.read ?? "").split(",").filter(Boolean)) {
    report[`read ${p}`] = attempt(() => statSync(p).isDirectory() ? readdirSync(p).join("|") : readFileSync(p, "utf8"));
  }
  return { content: [{ type: "text", text: JSON.stringify(report) }], details: report };
}
