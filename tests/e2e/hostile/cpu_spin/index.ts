export async function execute(): Promise<never> {
  let x = 0;
  for (;;) x = (x + 1) | 0; // never yields, never checks the signal
}
