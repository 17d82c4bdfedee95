type Block = { type: string; text: string };
export async function execute(_id: string, _params: unknown, _signal?: AbortSignal,
  onUpdate?: (p: { content: Block[] }) => void) {
  // Says it runs (evidence for tests), lets the event loop send that, then spins.
  onUpdate?.({ content: [{ type: "text", text: "spinning" }] });
  await new Promise((r) => setTimeout(r, 20));
  for (;;) { /* spin: ignores the abort signal and blocks the event loop */ }
}
