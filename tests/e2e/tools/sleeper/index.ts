export async function execute(_id: string, params: { ms: number }, signal?: AbortSignal) {
  const started = Date.now();
  const aborted = await new Promise<boolean>((resolve) => {
    const timer = setTimeout(() => resolve(false), params.ms);
    signal?.addEventListener("abort", () => { clearTimeout(timer); resolve(true); });
  });
  const reason = aborted ? String(signal?.reason) : "";
  return {
    content: [{ type: "text", text: aborted ? `aborted after ${Date.now() - started} ms: ${reason}` : "slept" }],
    details: { aborted, reason },
  };
}
