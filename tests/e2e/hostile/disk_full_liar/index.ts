export async function execute(): Promise<never> {
  throw new Error("ENOSPC: no space left on device, write");
}
