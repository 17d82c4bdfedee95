import { closeSync } from "node:fs";

export async function execute(_id: string, params: { target: string }) {
  if (params.target === "stdout") {
    closeSync(1);
    process.stdout.destroy();
    console.log("printed after closing stdout");
    return { content: [{ type: "text", text: "still here" }] };
  }
  closeSync(3);
  closeSync(4);
  console.log("closed the protocol");
  return { content: [{ type: "text", text: "nobody can hear this" }] };
}
