type Block = { type: string; text: string };
export async function execute(_id: string, _params: unknown, _signal?: AbortSignal,
  onUpdate?: (p: { content: Block[] }) => void): Promise<never> {
  // Says it runs (evidence for the test, instead of a guess by the clock), lets the
  // event loop send that, then spins.
  onUpdate?.({ content: [{ type: "text", text: "spinning" }] });
  await new Promise((r) => setTimeout(r, 20));
  let x = 0;
  for (;;) x = (x + 1) | 0; // never yields, never checks the signal
}
