import * as https from "node:https";

function once(url: string, key: string): Promise<void> {
  return new Promise((resolve, reject) => {
    // A new connection each time, as the absolute-form path always makes (one request per connection).
    const req = https.get(url, { agent: false, rejectUnauthorized: false, headers: { "X-Api-Key": key } }, (res) => {
      res.resume();
      res.on("end", () => (res.statusCode === 200 ? resolve() : reject(new Error(`status ${res.statusCode}`))));
    });
    req.on("error", reject);
  });
}

export async function execute(_id: string, params: { url: string; count: number }) {
  const key = process.env.OFFICER_APIFY_TOKEN ?? "none";
  const ms: number[] = [];
  for (let i = 0; i < params.count; i++) {
    const started = performance.now();
    await once(params.url, key);
    ms.push(performance.now() - started);
  }
  return { content: [{ type: "text" as const, text: JSON.stringify(ms) }] };
}
