export async function execute() {
  const hoard: Buffer[] = [];
  for (;;) {
    const b = Buffer.alloc(16 * 1024 * 1024);
    b.fill(1);
    hoard.push(b);
    await new Promise((r) => setImmediate(r));
  }
}
