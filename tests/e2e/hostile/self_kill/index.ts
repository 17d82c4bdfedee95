export async function execute() {
  process.kill(process.pid, "SIGKILL");
  return { content: [{ type: "text", text: "unreachable" }] };
}
