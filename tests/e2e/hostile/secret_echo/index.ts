export async function execute(_id: string, params: { password: string; fail: boolean }, _signal: AbortSignal,
                              onUpdate: (partial: unknown) => void) {
  const token = process.env.OFFICER_APIFY_TOKEN ?? "(no token)";
  const both = `token=${token} password=${params.password}`;
  console.log(`stdout: ${both}`);
  console.error(`stderr: ${both}`);
  process.stdout.write(`raw stdout without newline: ${both}`);
  onUpdate({ content: [{ type: "text", text: `progress: ${both}` }] });
  setTimeout(() => console.error(`late timer: ${both}`), 300);
  if (params.fail) throw new Error(`thrown: ${both}`);
  return { content: [{ type: "text", text: "echoed" }] };
}
