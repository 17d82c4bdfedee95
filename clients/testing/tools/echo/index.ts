export async function execute(toolCallId: string, params: { text: string; mode?: string; times?: number; token?: string }) {
  const text = params.mode === "loud" ? params.text.toUpperCase() : params.text;
  const seen = {
    toolCallId,
    params,
    OFFICER_RESOURCES: process.env.OFFICER_RESOURCES ?? null,
    PI_SEARXNG_URL: process.env.PI_SEARXNG_URL ?? null,
    OFFICER_APIFY_TOKEN: process.env.OFFICER_APIFY_TOKEN ?? null,
  };
  return {
    content: [{ type: "text", text: Array(params.times ?? 1).fill(text).join(" ") }, { type: "text", text: JSON.stringify(seen) }],
  };
}
