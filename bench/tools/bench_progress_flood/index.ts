type Block = { type: 'text'; text: string };

export async function execute(
  _toolCallId: string,
  params: { steps: number },
  _signal?: AbortSignal,
  onUpdate?: (partial: { content: Block[] }) => void,
) {
  for (let i = 1; i <= params.steps; i++) {
    onUpdate?.({ content: [{ type: 'text', text: `step ${i}` }] });
  }
  return { content: [{ type: 'text', text: `sent ${params.steps} progress updates` }] };
}
