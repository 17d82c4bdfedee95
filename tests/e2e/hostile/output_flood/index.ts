export async function execute(_id: string, params: { stream: "stdout" | "stderr"; mb: number }) {
  const line = "x".repeat(1023) + "\n";
  const chunk = line.repeat(64); // 64 KiB of 1 KiB lines
  const out = params.stream === "stdout" ? process.stdout : process.stderr;
  const started = Date.now();
  for (let i = 0; i < params.mb * 16; i++) out.write(chunk); // synchronous on a pipe: blocks when it is full
  const writeMs = Date.now() - started;
  return { content: [{ type: "text", text: `printed ${params.mb} MiB to ${params.stream}` }], details: { writeMs } };
}
