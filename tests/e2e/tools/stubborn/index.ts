export async function execute() {
  for (;;) { /* spin: ignores the abort signal and blocks the event loop */ }
}
