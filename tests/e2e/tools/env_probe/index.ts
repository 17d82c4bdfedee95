const NAMES = ["HOME", "OFFICER_USER_HOME", "OFFICER_USER_ROOT", "PI_TOOLS_DIRS", "OFFICER_EMAIL_DB",
  "OFFICER_RESOURCES", "PI_SEARXNG_URL", "OFFICER_APIFY_TOKEN"];
export async function execute() {
  const env: Record<string, string | undefined> = {};
  for (const n of NAMES) env[n] = process.env[n];
  return { content: [{ type: "text", text: JSON.stringify(env) }],
           details: { env, uid: process.getuid?.(), gid: process.getgid?.(), cwd: process.cwd() } };
}
