export async function execute(_id: string, params: { marker: string }) {
  for (let i = 1; i <= 30; i++) process.stderr.write(`${params.marker} line ${i}\n`);
  setTimeout(() => process.exit(7), 200);
  await new Promise((r) => setTimeout(r, 5000));
  return { content: [{ type: "text", text: "unreachable" }] };
}
