/** The shapes of PROTOCOL.md (version 1) and of this project's sandbox/status. */

export type ContentBlock =
  | { type: "text"; text: string }
  | { type: "image"; data: string; mimeType: string }
  | { type: string; [key: string]: unknown };

export interface JsonSchemaProperty {
  type?: "string" | "number" | "boolean";
  enum?: string[];
  description?: string;
  default?: unknown;
  /** Set on TOOL.md inputs marked `sensitive`. */
  writeOnly?: boolean;
  [key: string]: unknown;
}

export interface InputSchema {
  type: "object";
  properties: Record<string, JsonSchemaProperty>;
  required?: string[];
  additionalProperties?: boolean;
}

export interface Tool {
  name: string;
  label: string;
  description: string;
  version: number;
  language: string;
  source: "global" | "user";
  inputSchema: InputSchema;
  /** The TOOL.md body: the documentation the agent reads. */
  documentation: string;
  /** What one call may reach, receive and open (TOOL.md's permissions block); null when undeclared. */
  permissions: Permissions | null;
}

export interface Permissions {
  /** Hosts, as egress.allow writes them; "*" leaves every host to the operator's policy. */
  network: string[];
  /** Call env names the tool receives. */
  env: string[];
  email: "none" | "read" | "write";
  /** Whether the tool reaches the browser relay. */
  browser: boolean;
}

export type CallStatus = "ok" | "error" | "timeout" | "cancelled" | "crashed";

export interface CallResult {
  content: ContentBlock[];
  isError: boolean;
  status: CallStatus;
  durationMs: number;
  details?: unknown;
}

export interface CallParams {
  /** Whose data, user tools and sandboxes. */
  user: string;
  name: string;
  arguments?: Record<string, unknown>;
  /** Passed to the tool's execute(); the daemon generates one when absent. */
  toolCallId?: string;
  /** Integration variables (names from the daemon's calls.allowed_env). */
  env?: Record<string, string>;
  /** The run's deadline in the sandbox; the client's own deadline is this plus its grace. */
  timeoutMs?: number;
}

export interface Progress {
  /** 1, 2, 3, … in the order the tool called onUpdate. */
  progress: number;
  content: ContentBlock[];
}

export interface CallOptions {
  /** Aborting sends notifications/cancelled; the daemon then answers with status "cancelled". */
  signal?: AbortSignal;
  onProgress?: (update: Progress) => void;
}

export interface PoolCounts {
  starting: number;
  idle: number;
  busy: number;
  stopping: number;
  waiting: number;
}

export interface Status {
  version: string;
  protocol: number;
  backend: string;
  transport: string;
  unsandboxed: boolean;
  uptimeS: number;
  stopping: boolean;
  connections: number;
  callsInFlight: number;
  calls: Record<string, number>;
  pool: {
    totals: PoolCounts;
    users: Record<string, PoolCounts>;
    counters: Record<string, number>;
  };
  limits: {
    maxPerUser: number;
    maxTotal: number;
    minIdle: number;
    idleTtlS: number;
    defaultTimeoutMs: number;
    maxTimeoutMs: number;
    /** The env names a call may set (absent on daemons older than this client). */
    allowedEnv?: string[];
  };
  [key: string]: unknown;
}
