export async function execute() {
  return { content: [{ type: "text", text: "the quota is exhausted; ask the user to raise it" }], isError: true };
}
