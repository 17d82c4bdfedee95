type Block = { type: string; text: string };
export async function execute(toolCallId: string, params: { ms: number }, signal?: AbortSignal,
  onUpdate?: (p: { content: Block[] }) => void) {
  onUpdate?.({ content: [{ type: "text", text: "running" }] });
  const aborted = await new Promise<boolean>((resolve) => {
    const timer = setTimeout(() => resolve(false), params.ms);
    signal?.addEventListener("abort", () => { clearTimeout(timer); resolve(true); });
  });
  return { content: [{ type: "text", text: aborted ? `aborted: ${String(signal?.reason)}` : "slept" }],
           details: { toolCallId, aborted, reason: aborted ? String(signal?.reason) : "" } };
}
