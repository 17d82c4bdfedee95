import { hostname } from "node:os";

export async function execute(_id: string, params: { ms: number }) {
  setTimeout(() => {
    Promise.reject(new Error("late_rejection's promise rejected after it returned"));
  }, params.ms);
  setTimeout(() => {
    throw new Error("late_rejection's timer threw after it returned");
  }, params.ms + 50);
  return { content: [{ type: "text", text: "returned" }], details: { sandbox: hostname() } };
}
