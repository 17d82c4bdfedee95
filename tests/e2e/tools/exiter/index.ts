export async function execute(_id: string, params: { code: number }) {
  setTimeout(() => process.exit(params.code), 10);
  await new Promise((r) => setTimeout(r, 5000));
  return { content: [{ type: "text", text: "unreachable" }] };
}
