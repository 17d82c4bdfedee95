/**
 * @sandboxd/pi: a pi extension that gives a session the tools of one sandboxd user.
 *
 * At session start it lists the user's tools (which also warms their sandboxes) and
 * registers each with pi. A call goes to sandboxd with pi's toolCallId, params and
 * AbortSignal; progress streams into onUpdate; the integration variables come from
 * the environment. pi ignores `isError` in a returned result, so every status other
 * than `ok` is thrown: the agent sees a failure as a failure.
 */

import type { ExtensionAPI, ExtensionFactory, ToolDefinition } from "@mariozechner/pi-coding-agent";
import {
  type CallResult, type ContentBlock, ErrorCode, type InputSchema, SandboxdClient, SandboxdError, type Tool,
} from "@sandboxd/client";
import { type TSchema, Type } from "typebox";

/** TOOLS.md's integration variables: what a daemon that does not say (sandbox/status) allows. */
export const DEFAULT_ENV_NAMES = [
  "OFFICER_RESOURCES",
  "PI_SEARXNG_URL",
  "OFFICER_APIFY_TOKEN",
  "OFFICER_BROWSER_RELAY_PORT",
  "OFFICER_BROWSER_RELAY_TOKEN",
];

// What every model provider accepts as a function name.
const TOOL_NAME = /^[A-Za-z0-9_-]{1,64}$/;

export interface SandboxdPiOptions {
  /** The user (an email address) whose tools, data and sandboxes the session uses. */
  user: string;
  /** Where sandboxd listens; else SANDBOXD_SOCKET, else /run/sandboxd/sandboxd.sock. */
  socketPath?: string;
  /** Where the integration variables are read from (default process.env). */
  env?: Record<string, string | undefined>;
  /** The env names passed to calls; default: the daemon's calls.allowed_env. */
  envNames?: string[];
  /** timeoutMs of each call (default: the client's, 30 s). */
  timeoutMs?: number;
  /** An existing client (pi-bridge's); default: one per session, closed at session shutdown. */
  client?: SandboxdClient;
  /** Where problems are reported (default: stderr). */
  log?: (line: string) => void;
}

/** What a call leaves in pi's session: its status and duration, never its env or arguments. */
export interface SandboxdDetails {
  /** `over_quota`: sandboxd refused the call (-32004) before it ran. */
  status: CallResult["status"] | "running" | "over_quota";
  durationMs?: number;
  progress?: number;
}

/** A call that did not end `ok`; `message` is the tool's text (what the agent reads). */
export class SandboxdToolError extends Error {
  readonly details: SandboxdDetails;

  constructor(message: string, details: SandboxdDetails) {
    super(message);
    this.name = "SandboxdToolError";
    this.details = details;
  }
}

const stderr = (line: string): void => {
  process.stderr.write(`${line}\n`);
};

/** The extension for pi-bridge's SDK embedding: `extensionFactories: [createSandboxdExtension({ user, env })]`. */
export function createSandboxdExtension(options: SandboxdPiOptions): ExtensionFactory {
  const log = options.log ?? stderr;
  return (pi: ExtensionAPI) => {
    const client = options.client ?? new SandboxdClient({ socketPath: options.socketPath });
    // pi gives a thrown error's result empty details; its tool_result hook may set them. So a
    // failed call's status and duration wait here, by toolCallId, until pi builds that result.
    const failed = new Map<string, SandboxdDetails>();
    pi.on("session_start", async () => {
      await registerTools(pi, client, options, log, (toolCallId, details) => failed.set(toolCallId, details));
    });
    pi.on("tool_result", (event) => {
      const details = failed.get(event.toolCallId);
      if (details === undefined) return undefined;
      failed.delete(event.toolCallId);
      return { details };
    });
    pi.on("session_shutdown", async () => {
      failed.clear();
      if (options.client === undefined) client.close();
    });
  };
}

/** The extension pi loads from this package: the user comes from SANDBOXD_USER, the socket from SANDBOXD_SOCKET. */
export default function sandboxdExtension(pi: ExtensionAPI): void {
  const user = process.env.SANDBOXD_USER;
  if (!user) {
    stderr("[@sandboxd/pi] SANDBOXD_USER is not set, so no sandboxd tools were loaded; set it to the email address "
      + "of the user whose tools this session uses (and SANDBOXD_SOCKET if sandboxd listens elsewhere).");
    return;
  }
  createSandboxdExtension({ user })(pi);
}

/** Told the details of each call that did not end `ok`, just before its error is thrown. */
export type FailureListener = (toolCallId: string, details: SandboxdDetails) => void;

async function registerTools(pi: ExtensionAPI, client: SandboxdClient, options: SandboxdPiOptions,
  log: (line: string) => void, onFailure: FailureListener) {
  let tools: Tool[];
  let allowedEnv: string[] | undefined;
  try {
    // Listing warms the user's sandboxes: the first call finds one ready.
    const [listed, status] = await Promise.all([client.listTools(options.user), client.status()]);
    tools = listed;
    allowedEnv = status.limits.allowedEnv;
  } catch (error) {
    log(`[@sandboxd/pi] could not load the tools of ${options.user} from sandboxd on ${client.socketPath}: `
      + `${error instanceof Error ? error.message : String(error)} pi starts without sandboxd's tools; `
      + "they come back at the next session once sandboxd runs.");
    return;
  }
  const envNames = options.envNames ?? allowedEnv ?? DEFAULT_ENV_NAMES;
  const taken = new Set(pi.getAllTools().map((tool) => tool.name));
  for (const tool of tools) {
    if (!TOOL_NAME.test(tool.name)) {
      log(`[@sandboxd/pi] skipped the sandboxd tool ${JSON.stringify(tool.name)}: a tool name must match ${TOOL_NAME}.`);
      continue;
    }
    if (taken.has(tool.name)) {
      // A user's tool must not stand in for one of pi's (or another extension's) under the same name.
      log(`[@sandboxd/pi] skipped the sandboxd tool ${tool.name}: pi already has a tool of that name; rename one of them.`);
      continue;
    }
    pi.registerTool(toolDefinition(tool, client, options, envNames, onFailure));
  }
}

/** pi's registration of one sandboxd tool. */
export function toolDefinition(tool: Tool, client: SandboxdClient, options: SandboxdPiOptions, envNames: string[],
  onFailure?: FailureListener): ToolDefinition {
  const documentation = tool.documentation.trim();
  return {
    name: tool.name,
    label: tool.label || tool.name,
    // The model reads a tool's description in its tool list: the TOOL.md body is the documentation it is written for.
    description: documentation ? `${tool.description}\n\n${documentation}` : tool.description,
    promptSnippet: tool.description,
    parameters: toolParameters(tool.inputSchema),
    async execute(toolCallId, params, signal, onUpdate) {
      const result = await client.callTool(
        {
          user: options.user,
          name: tool.name,
          arguments: (params ?? {}) as Record<string, unknown>,
          toolCallId,
          env: integrationEnv(options.env ?? process.env, envNames),
          timeoutMs: options.timeoutMs,
        },
        {
          signal,
          onProgress: onUpdate && ((update) => onUpdate({
            content: piContent(update.content),
            details: { status: "running", progress: update.progress } satisfies SandboxdDetails,
          })),
        },
      ).catch((error: unknown) => {
        if (!(error instanceof SandboxdError && error.code === ErrorCode.QuotaExceeded)) throw error;
        const details: SandboxdDetails = { status: "over_quota" };
        onFailure?.(toolCallId, details);
        throw new SandboxdToolError(overQuotaMessage(tool.name, error), details);
      });
      const details: SandboxdDetails = { status: result.status, durationMs: result.durationMs };
      if (result.status !== "ok") {
        // Thrown, not returned: pi marks a call failed only when execute throws.
        onFailure?.(toolCallId, details);
        throw new SandboxdToolError(resultText(result) || `${tool.name} ended with status ${result.status}.`, details);
      }
      return { content: piContent(result.content), details };
    },
  };
}

/**
 * What the agent reads when sandboxd refuses a call over the user's disk quota (-32004): what
 * happened, the biggest entries (the error's `data`), and what it can do about it. The
 * daemon's own message is kept when `data` does not say which limit was passed.
 */
export function overQuotaMessage(toolName: string, error: SandboxdError): string {
  const usage = quotaUsage(error.data);
  const passed = usage === undefined ? undefined : quotaPassed(usage);
  const biggest = (usage?.biggest ?? []).map((entry) => `${entry.path} (${sizeText(entry.bytes)})`);
  return [
    `${toolName} did not run: this user's folders (/officer/user and /officer/data) are over their disk quota`
      + `${passed ? `, ${passed}` : ""}.`,
    "sandboxd runs none of this user's tools until the folders hold less.",
    biggest.length > 0 ? `The biggest entries: ${biggest.join(", ")}.` : "",
    "To go on, delete files that are no longer needed from those folders, then call the tool again.",
    "If nothing there may be deleted, tell the user: their sandboxd operator can free space or raise the quota.",
    passed ? "" : `sandboxd said: ${error.message}`,
  ].filter(Boolean).join(" ");
}

interface QuotaUsage {
  bytes: number;
  limitBytes: number;
  inodes: number;
  limitInodes: number;
  biggest?: Array<{ path: string; bytes: number }>;
}

/** The -32004 error's data (PROTOCOL.md), or undefined when it is not that shape. */
function quotaUsage(data: unknown): QuotaUsage | undefined {
  if (typeof data !== "object" || data === null) return undefined;
  const usage = data as Record<string, unknown>;
  if (!["bytes", "limitBytes", "inodes", "limitInodes"].every((key) => typeof usage[key] === "number")) return undefined;
  const entries = Array.isArray(usage.biggest) ? usage.biggest : [];
  const biggest = entries.filter((entry): entry is { path: string; bytes: number } =>
    typeof entry?.path === "string" && typeof entry?.bytes === "number");
  return { ...(usage as unknown as QuotaUsage), biggest };
}

/** Which limit the folders passed, in words; undefined when the figures show neither. */
function quotaPassed(usage: QuotaUsage): string | undefined {
  if (usage.bytes > usage.limitBytes) return `${sizeText(usage.bytes)} of ${sizeText(usage.limitBytes)}`;
  if (usage.inodes > usage.limitInodes) return `${usage.inodes} files and folders of ${usage.limitInodes}`;
  return undefined;
}

/** Bytes for a person, as sandboxd writes them: 12.0 MiB. */
export function sizeText(bytes: number): string {
  for (const [unit, scale] of [["GiB", 2 ** 30], ["MiB", 2 ** 20], ["KiB", 2 ** 10]] as const) {
    if (bytes >= scale) return `${(bytes / scale).toFixed(1)} ${unit}`;
  }
  return `${bytes} B`;
}

/** The daemon's inputSchema as a TypeBox schema (enum, optional, default, sensitive carried over). */
export function toolParameters(schema: InputSchema): TSchema {
  const required = new Set(schema.required ?? []);
  const fields: Array<[string, TSchema]> = [];
  for (const [name, property] of Object.entries(schema.properties ?? {})) {
    const options: Record<string, unknown> = {};
    if (property.description !== undefined) options.description = property.description;
    if (property.default !== undefined) options.default = property.default;
    if (property.writeOnly) options.writeOnly = true;
    let field: TSchema;
    if (Array.isArray(property.enum)) {
      // A plain string enum, not a union of literals: every provider accepts it.
      field = Type.Unsafe<string>({ type: "string", enum: property.enum, ...options });
    } else if (property.type === "number") {
      field = Type.Number(options);
    } else if (property.type === "boolean") {
      field = Type.Boolean(options);
    } else {
      field = Type.String(options);
    }
    fields.push([name, required.has(name) ? field : Type.Optional(field)]);
  }
  // fromEntries defines every name as an own property, "__proto__" included.
  return Type.Object(Object.fromEntries(fields), { additionalProperties: false });
}

/** The integration variables to pass: the allowed names that are set in `source`. */
export function integrationEnv(source: Record<string, string | undefined>, names: string[]): Record<string, string> {
  const env: Record<string, string> = {};
  for (const name of names) {
    const value = source[name];
    if (typeof value === "string") env[name] = value;
  }
  return env;
}

type PiContent = { type: "text"; text: string } | { type: "image"; data: string; mimeType: string };

function piContent(content: ContentBlock[]): PiContent[] {
  return content.map((block): PiContent => {
    if (block.type === "text" && typeof block.text === "string") return { type: "text", text: block.text };
    if (block.type === "image" && typeof block.data === "string" && typeof block.mimeType === "string") {
      return { type: "image", data: block.data, mimeType: block.mimeType };
    }
    return { type: "text", text: JSON.stringify(block) }; // a block pi has no type for: shown as it came
  });
}

function resultText(result: CallResult): string {
  return result.content
    .filter((block): block is { type: "text"; text: string } => block.type === "text" && typeof block.text === "string")
    .map((block) => block.text)
    .join("\n")
    .trim();
}
