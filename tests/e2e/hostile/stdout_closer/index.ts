import { closeSync } from "node:fs";

export async function execute() {
  closeSync(1);
  process.stdout.destroy();
  console.log("printed after closing stdout");
  return { content: [{ type: "text", text: "still here" }] };
}
