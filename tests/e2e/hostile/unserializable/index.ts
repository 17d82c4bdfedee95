export async function execute(_id: string, params: { kind: string }) {
  const details: Record<string, unknown> = {};
  if (params.kind === "bigint") details.big = 10n ** 30n;
  else details.self = details;
  return { content: [{ type: "text", text: "looks fine" }], details };
}
