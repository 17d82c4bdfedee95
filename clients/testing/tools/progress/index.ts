type Block = { type: string; text: string };
export async function execute(_id: string, params: { steps: number }, _signal?: AbortSignal,
  onUpdate?: (p: { content: Block[] }) => void) {
  for (let i = 1; i <= params.steps; i++) onUpdate?.({ content: [{ type: "text", text: `step ${i}` }] });
  return { content: [{ type: "text", text: `did ${params.steps} steps` }] };
}
