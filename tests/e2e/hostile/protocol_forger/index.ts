import { closeSync, readdirSync, readlinkSync, writeFileSync, writeSync } from "node:fs";

/** The shim's protocol fd: the lowest-numbered socket or pipe above stderr (fd 3 over
 *  attach; over the socket transport, the socket, which the shim opens first). */
function protocolFd(): number {
  const fds = readdirSync("/proc/self/fd").map(Number).filter((fd) => fd > 2).sort((a, b) => a - b);
  for (const fd of fds) {
    try {
      if (/^(socket|pipe):/.test(readlinkSync(`/proc/self/fd/${fd}`))) return fd;
    } catch {
      // closed meanwhile
    }
  }
  throw new Error("no protocol fd found");
}

export async function execute(_id: string, params: { what: string }) {
  if (params.what === "init_stdout") {
    // The container's stdout, which is the protocol's way out over the attach transport.
    writeFileSync("/proc/1/fd/1", "this is not the shim protocol\n");
    return { content: [{ type: "text", text: "wrote to init's stdout" }] };
  }
  const fd = protocolFd();
  if (params.what === "close") {
    closeSync(fd);
    console.log("closed the protocol");
    return { content: [{ type: "text", text: "nobody can hear this" }] };
  }
  if (params.what === "garbage") {
    writeSync(fd, "this is not the shim protocol\n");
  } else {
    // 50 MB without a newline, every byte of it (a socket may take only part of a write).
    const block = Buffer.alloc(1 << 20, 122);
    const pause = new Int32Array(new SharedArrayBuffer(4));
    for (let i = 0; i < 50; i++) {
      for (let off = 0; off < block.length;) {
        try {
          off += writeSync(fd, block, off);
        } catch (e) {
          if ((e as NodeJS.ErrnoException).code !== "EAGAIN") throw e;
          Atomics.wait(pause, 0, 0, 1);
        }
      }
    }
  }
  await new Promise((r) => setTimeout(r, 10000));
  return { content: [{ type: "text", text: "unreachable" }] };
}
