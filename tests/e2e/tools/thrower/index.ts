export async function execute(): Promise<never> {
  throw new Error("the database is on fire");
}
