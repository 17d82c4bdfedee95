import { spawn } from "node:child_process";
import { hostname } from "node:os";

export async function execute(_id: string, params: { marker: string; hang?: boolean }) {
  const m = params.marker;
  // The child: a shell that waits forever. The grandchild: setsid'd and double-forked,
  // so it is re-parented to the sandbox's init and belongs to no process group of ours.
  const child = spawn("/bin/sh", ["-c", `sleep 100000; echo ${m}-child`], { stdio: "ignore" });
  child.on("error", () => {});
  const grand = spawn("/bin/sh", ["-c", `(setsid /bin/sh -c 'sleep 100000; echo ${m}-grandchild' &)`], {
    detached: true,
    stdio: "ignore",
  });
  grand.on("error", () => {});
  await new Promise((r) => grand.on("exit", r)); // the intermediate shell exits at once
  if (params.hang !== false) await new Promise(() => {});
  return { content: [{ type: "text", text: "left two processes behind" }], details: { sandbox: hostname() } };
}
