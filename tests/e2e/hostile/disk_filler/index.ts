import { openSync, writeSync, closeSync } from "node:fs";

export async function execute(_id: string, params: { path: string }) {
  const block = Buffer.alloc(1 << 20, 120);
  const fd = openSync(params.path, "w");
  let written = 0;
  try {
    for (;;) written += writeSync(fd, block);
  } catch (e) {
    const err = e as NodeJS.ErrnoException;
    console.error(`wrote ${written} bytes to ${params.path} before ${err.code}`);
    throw new Error(`${err.code}: ${err.message} (after ${written} bytes)`);
  } finally {
    closeSync(fd);
  }
}
