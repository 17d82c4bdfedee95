/**
 * A client of sandboxd's socket: one connection, many requests in flight on it,
 * answers matched by id, progress passed to the call it belongs to.
 *
 * Nothing waits forever: every request has a client-side deadline (for a call,
 * its timeoutMs plus a grace that covers the daemon's queueing and cancel grace).
 * When the connection drops, every request in flight fails with
 * ConnectionLostError and the next request connects afresh, so a restarted
 * daemon is picked up without a new client.
 */

import net from "node:net";

import {
  AbortError,
  ConnectionLostError,
  DaemonUnreachableError,
  DeadlineExceededError,
  ErrorCode,
  InvalidRequestError,
  SandboxdError,
  errorFromRpc,
} from "./errors.js";
import type { CallOptions, CallParams, CallResult, ContentBlock, Status, Tool } from "./types.js";

export const DEFAULT_SOCKET = "/run/sandboxd/sandboxd.sock";
/** The daemon's calls.default_timeout_ms. */
export const DEFAULT_TIMEOUT_MS = 30_000;
/** Queueing for a sandbox (pool.acquire_timeout_ms, 10 s) + the cancel grace (2 s) + slack. */
export const DEFAULT_DEADLINE_GRACE_MS = 15_000;
/** For ping, tools/list and sandbox/status (a first tools scan of a large tree takes a while). */
export const DEFAULT_REQUEST_TIMEOUT_MS = 30_000;
export const DEFAULT_CONNECT_TIMEOUT_MS = 5_000;
/** The daemon's max_message_bytes: a longer line would be answered with id null, matched to nothing. */
export const DEFAULT_MAX_MESSAGE_BYTES = 16 << 20;

export interface ClientOptions {
  /** Where the daemon listens; else SANDBOXD_SOCKET, else /run/sandboxd/sandboxd.sock. */
  socketPath?: string;
  /** The environment SANDBOXD_SOCKET is read from (default process.env). */
  env?: Record<string, string | undefined>;
  /** timeoutMs sent with a call that names none. */
  defaultTimeoutMs?: number;
  /** Added to a call's timeoutMs for the client-side deadline. */
  deadlineGraceMs?: number;
  /** Deadline of requests other than tools/call. */
  requestTimeoutMs?: number;
  connectTimeoutMs?: number;
  maxMessageBytes?: number;
}

export interface RequestOptions {
  /** Client-side deadline of this request. */
  deadlineMs?: number;
  signal?: AbortSignal;
  onProgress?: (params: { progress: number; content: ContentBlock[] }) => void;
}

interface Pending {
  id: number;
  method: string;
  resolve: (value: unknown) => void;
  reject: (error: Error) => void;
  onProgress?: RequestOptions["onProgress"];
  sent: boolean;
  finish: () => void; // clears the deadline and the abort listener
}

export function resolveSocketPath(socketPath?: string, env: Record<string, string | undefined> = process.env): string {
  return socketPath || env.SANDBOXD_SOCKET || DEFAULT_SOCKET;
}

function abortReason(signal: AbortSignal): string {
  const reason: unknown = signal.reason;
  if (reason instanceof Error && reason.message) return reason.message;
  if (typeof reason === "string" && reason) return reason;
  return "aborted by the client";
}

export class SandboxdClient {
  readonly socketPath: string;
  private readonly defaultTimeoutMs: number;
  private readonly deadlineGraceMs: number;
  private readonly requestTimeoutMs: number;
  private readonly connectTimeoutMs: number;
  private readonly maxMessageBytes: number;
  private socket: net.Socket | null = null;
  private connecting: Promise<net.Socket> | null = null;
  private readonly pending = new Map<number, Pending>();
  private nextId = 1;
  private closed = false;

  constructor(options: ClientOptions = {}) {
    this.socketPath = resolveSocketPath(options.socketPath, options.env);
    this.defaultTimeoutMs = options.defaultTimeoutMs ?? DEFAULT_TIMEOUT_MS;
    this.deadlineGraceMs = options.deadlineGraceMs ?? DEFAULT_DEADLINE_GRACE_MS;
    this.requestTimeoutMs = options.requestTimeoutMs ?? DEFAULT_REQUEST_TIMEOUT_MS;
    this.connectTimeoutMs = options.connectTimeoutMs ?? DEFAULT_CONNECT_TIMEOUT_MS;
    this.maxMessageBytes = options.maxMessageBytes ?? DEFAULT_MAX_MESSAGE_BYTES;
  }

  // -- the methods of PROTOCOL.md --------------------------------------------

  async ping(): Promise<void> {
    await this.request("ping");
  }

  /** The tools a user may call (global ones, overridden by their own). With a user, this warms their pool. */
  async listTools(user?: string): Promise<Tool[]> {
    const result = (await this.request("tools/list", user === undefined ? {} : { user })) as { tools: Tool[] };
    return result.tools;
  }

  async status(): Promise<Status> {
    return (await this.request("sandbox/status")) as Status;
  }

  /**
   * Run a tool. Resolves with the daemon's result whatever its status (a failed tool
   * is a result, not an exception); rejects on a protocol error (typed by code), a
   * lost connection or the client-side deadline.
   */
  async callTool(params: CallParams, options: CallOptions = {}): Promise<CallResult> {
    const timeoutMs = params.timeoutMs ?? this.defaultTimeoutMs;
    const onProgress = options.onProgress;
    const result = await this.request(
      "tools/call",
      { ...params, arguments: params.arguments ?? {}, timeoutMs },
      {
        deadlineMs: timeoutMs + this.deadlineGraceMs,
        signal: options.signal,
        onProgress: onProgress && ((update) => onProgress({ progress: update.progress, content: update.content })),
      },
    );
    return result as CallResult;
  }

  /** Close the connection; requests in flight fail with ConnectionLostError. */
  close(): void {
    this.closed = true;
    this.socket?.destroy();
    this.socket = null;
    this.failAll(new ConnectionLostError("the sandboxd client was closed with this request in flight."));
  }

  // -- requests ----------------------------------------------------------------

  /** Send one request and wait for its answer. */
  request(method: string, params?: Record<string, unknown>, options: RequestOptions = {}): Promise<unknown> {
    if (this.closed) return Promise.reject(new SandboxdError("the sandboxd client is closed; make a new one."));
    const { signal } = options;
    if (signal?.aborted) return Promise.reject(new AbortError(`${method} was aborted before it was sent (${abortReason(signal)}).`));
    const id = this.nextId++;
    const message: Record<string, unknown> = { jsonrpc: "2.0", id, method };
    if (params !== undefined) {
      message.params = options.onProgress ? { ...params, _meta: { progressToken: id } } : params;
    }
    const line = JSON.stringify(message) + "\n";
    if (Buffer.byteLength(line) > this.maxMessageBytes) {
      return Promise.reject(new InvalidRequestError(ErrorCode.InvalidRequest,
        `${method} request is ${Buffer.byteLength(line)} bytes, over the daemon's limit of ${this.maxMessageBytes}; send smaller arguments.`));
    }
    const deadlineMs = options.deadlineMs ?? this.requestTimeoutMs;

    return new Promise((resolve, reject) => {
      let timer: NodeJS.Timeout | undefined;
      const onAbort = () => {
        if (!entry.sent) {
          this.settle(entry, new AbortError(`${method} was aborted before it was sent (${abortReason(signal!)}).`));
          return;
        }
        // The daemon fires the tool's AbortSignal and answers "cancelled": keep waiting for that answer.
        this.notify("notifications/cancelled", { requestId: id, reason: abortReason(signal!) });
      };
      const entry: Pending = {
        id,
        method,
        resolve,
        reject,
        onProgress: options.onProgress,
        sent: false,
        finish: () => {
          clearTimeout(timer);
          signal?.removeEventListener("abort", onAbort);
        },
      };
      this.pending.set(id, entry);
      this.socket?.ref();
      signal?.addEventListener("abort", onAbort, { once: true });
      timer = setTimeout(() => {
        if (entry.sent) {
          this.notify("notifications/cancelled", { requestId: id, reason: `no answer within the client's deadline of ${deadlineMs} ms` });
        }
        this.settle(entry, new DeadlineExceededError(
          `sandboxd did not answer ${method} within ${deadlineMs} ms (on ${this.socketPath}); the request was cancelled.`,
          deadlineMs,
        ));
      }, deadlineMs);

      this.connect().then(
        (socket) => {
          if (!this.pending.has(id)) return; // aborted or past its deadline while connecting
          entry.sent = true;
          socket.write(line);
        },
        (error: Error) => this.settle(entry, error),
      );
    });
  }

  private notify(method: string, params: Record<string, unknown>): void {
    const socket = this.socket;
    if (socket !== null && !socket.destroyed) {
      socket.write(JSON.stringify({ jsonrpc: "2.0", method, params }) + "\n");
    }
  }

  private settle(entry: Pending, error: Error | null, value?: unknown): void {
    if (this.pending.get(entry.id) !== entry) return;
    this.pending.delete(entry.id);
    entry.finish();
    if (this.pending.size === 0) this.socket?.unref(); // an idle client never holds the process open
    if (error === null) entry.resolve(value);
    else entry.reject(error);
  }

  private failAll(error: Error): void {
    for (const entry of [...this.pending.values()]) this.settle(entry, error);
  }

  // -- the connection ------------------------------------------------------------

  private connect(): Promise<net.Socket> {
    if (this.socket !== null && !this.socket.destroyed) return Promise.resolve(this.socket);
    if (this.connecting === null) {
      this.connecting = this.open().finally(() => {
        this.connecting = null;
      });
    }
    return this.connecting;
  }

  private open(): Promise<net.Socket> {
    const path = this.socketPath;
    return new Promise((resolve, reject) => {
      const socket = net.createConnection({ path });
      const timer = setTimeout(() => {
        socket.destroy();
        reject(new DaemonUnreachableError(`sandboxd did not accept a connection on ${path} within ${this.connectTimeoutMs} ms; is it overloaded or stopped?`, path));
      }, this.connectTimeoutMs);
      socket.once("error", (error: NodeJS.ErrnoException) => {
        clearTimeout(timer);
        reject(unreachable(path, error));
      });
      socket.once("connect", () => {
        clearTimeout(timer);
        socket.removeAllListeners("error");
        if (this.closed) {
          socket.destroy();
          reject(new SandboxdError("the sandboxd client is closed; make a new one."));
          return;
        }
        this.attach(socket);
        resolve(socket);
      });
    });
  }

  private attach(socket: net.Socket): void {
    this.socket = socket;
    let chunks: Buffer[] = [];
    let lost: Error | null = null; // why the daemon dropped us, when it said so
    let socketError: Error | null = null;

    const handleLine = (line: Buffer): void => {
      let text = line.toString("utf8");
      if (text.endsWith("\r")) text = text.slice(0, -1);
      if (text.trim() === "") return;
      let message: any;
      try {
        message = JSON.parse(text);
      } catch {
        lost = new ConnectionLostError(`sandboxd on ${this.socketPath} sent a line that is not JSON; the connection was dropped.`);
        socket.destroy();
        return;
      }
      if (message === null || typeof message !== "object") return;
      if (message.method === "notifications/progress") {
        const params = message.params ?? {};
        const entry = this.pending.get(params.progressToken);
        if (entry?.onProgress !== undefined) {
          try {
            entry.onProgress({ progress: params.progress, content: Array.isArray(params.content) ? params.content : [] });
          } catch (error) {
            process.emitWarning(`a sandboxd progress callback threw: ${String(error)}`);
          }
        }
        return;
      }
      if (message.id === null || message.id === undefined) {
        // Not tied to a request. -32003 comes first on a refused connection, then the close.
        if (message.error?.code === ErrorCode.PeerRefused) lost = errorFromRpc(message.error);
        return;
      }
      const entry = this.pending.get(message.id);
      if (entry === undefined) return; // past its deadline, or aborted before it was sent
      if (message.error !== undefined) this.settle(entry, errorFromRpc(message.error));
      else this.settle(entry, null, message.result);
    };

    socket.on("data", (data: Buffer) => {
      let start = 0;
      let end = data.indexOf(10);
      while (end >= 0) {
        const piece = data.subarray(start, end);
        const line = chunks.length === 0 ? piece : Buffer.concat([...chunks, piece]);
        chunks = [];
        handleLine(line);
        start = end + 1;
        end = data.indexOf(10, start);
      }
      if (start < data.length) chunks.push(data.subarray(start));
    });
    socket.on("error", (error) => {
      socketError = error;
    });
    socket.on("close", () => {
      if (this.socket === socket) this.socket = null;
      const reason = lost ?? new ConnectionLostError(
        `the connection to sandboxd on ${this.socketPath} closed with this request in flight ` +
        `(${socketError?.message ?? "the daemon stopped or restarted"}); its outcome is unknown. ` +
        "The next request reconnects.",
      );
      this.failAll(reason);
    });
    if (this.pending.size === 0) socket.unref();
  }
}

function unreachable(path: string, error: NodeJS.ErrnoException): DaemonUnreachableError {
  switch (error.code) {
    case "ENOENT":
      return new DaemonUnreachableError(
        `no sandboxd is listening on ${path} (no such socket); start it with \`sandboxd serve\`, or set SANDBOXD_SOCKET (or socketPath) to where it listens.`,
        path, error);
    case "ECONNREFUSED":
      return new DaemonUnreachableError(
        `nothing accepts connections on ${path} (a socket file without a daemon: did sandboxd stop?); start it with \`sandboxd serve\`.`,
        path, error);
    case "EACCES":
    case "EPERM":
      return new DaemonUnreachableError(
        `permission denied on ${path}; join the socket's group (socket_group) or run as its owner.`, path, error);
    default:
      return new DaemonUnreachableError(`cannot connect to sandboxd on ${path}: ${error.message}`, path, error);
  }
}
