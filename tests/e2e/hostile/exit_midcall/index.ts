export async function execute() {
  await new Promise((r) => setTimeout(r, 20));
  process.exit(0);
}
