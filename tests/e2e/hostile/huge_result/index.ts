export async function execute(_id: string, params: { mb: number }) {
  const text = "y".repeat(params.mb * 1024 * 1024);
  return { content: [{ type: "text", text }, { type: "text", text: "second block" }] };
}
