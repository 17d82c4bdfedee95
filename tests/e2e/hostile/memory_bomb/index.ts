export async function execute() {
  const hoard: Buffer[] = [];
  for (;;) {
    // Buffers live outside the V8 heap, so the cgroup limit, not --max-old-space-size, is hit.
    hoard.push(Buffer.alloc(8 * 1024 * 1024, 1));
  }
}
