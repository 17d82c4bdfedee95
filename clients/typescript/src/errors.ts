/**
 * Errors, one class per JSON-RPC code of PROTOCOL.md, plus the client's own
 * (the daemon unreachable, the connection lost mid-call, a deadline passed).
 * `retryable` says whether the same request may succeed if sent again later.
 */

export const ErrorCode = {
  ParseError: -32700,
  InvalidRequest: -32600,
  MethodNotFound: -32601,
  InvalidParams: -32602,
  Overloaded: -32001,
  BackendUnavailable: -32002,
  PeerRefused: -32003,
  QuotaExceeded: -32004,
  InternalError: -32603,
} as const;

/** Base of every error this client throws. */
export class SandboxdError extends Error {
  /** The JSON-RPC code, or undefined for errors raised by the client itself. */
  readonly code: number | undefined;
  readonly data: unknown;
  readonly retryable: boolean;

  constructor(message: string, options: { code?: number; data?: unknown; retryable?: boolean; cause?: unknown } = {}) {
    super(message, options.cause === undefined ? undefined : { cause: options.cause });
    this.name = new.target.name;
    this.code = options.code;
    this.data = options.data;
    this.retryable = options.retryable ?? false;
  }
}

/** The daemon answered a request with a JSON-RPC error. */
export class RpcError extends SandboxdError {
  constructor(code: number, message: string, data?: unknown, retryable = false) {
    super(message, { code, data, retryable });
  }
}

/** -32700 / -32600: the daemon could not read the message (a bug in the client or a proxy in between). */
export class InvalidRequestError extends RpcError {}
/** -32601: the daemon does not know the method (an older daemon?). */
export class MethodNotFoundError extends RpcError {}
/** -32602: unknown tool, arguments failing inputSchema, malformed user, forbidden env name. */
export class InvalidParamsError extends RpcError {}
/** -32001: no sandbox within the queue deadline. Retry later. */
export class OverloadedError extends RpcError {
  constructor(code: number, message: string, data?: unknown) {
    super(code, message, data, true);
  }
}
/** -32002: Docker is down, the runner image is missing, or the daemon is shutting down. */
export class BackendUnavailableError extends RpcError {}
/** -32003: the daemon refuses this process's uid/groups (allowed_uids / allowed_gids). */
export class PeerRefusedError extends RpcError {}
/** -32004: the user's folders are over their disk quota; `data` has the usage and limits. Served again once they hold less. */
export class QuotaExceededError extends RpcError {}
/** -32603: a bug in the daemon; its log has the details. */
export class InternalError extends RpcError {}

/** Nothing listens on the socket, or this process may not connect to it. */
export class DaemonUnreachableError extends SandboxdError {
  readonly socketPath: string;

  constructor(message: string, socketPath: string, cause?: unknown) {
    super(message, { retryable: true, cause });
    this.socketPath = socketPath;
  }
}

/**
 * The connection closed while the request was in flight (the daemon restarted or
 * died). The daemon cancels a disconnected client's calls, but whether a tool's
 * side effects happened is unknown: not retried automatically.
 */
export class ConnectionLostError extends SandboxdError {
  constructor(message: string) {
    super(message, { retryable: false });
  }
}

/** No answer by the client-side deadline (the call's timeout plus grace); the call was cancelled. */
export class DeadlineExceededError extends SandboxdError {
  readonly deadlineMs: number;

  constructor(message: string, deadlineMs: number) {
    super(message, { retryable: false });
    this.deadlineMs = deadlineMs;
  }
}

/** The caller's AbortSignal fired before the request was sent. */
export class AbortError extends SandboxdError {
  constructor(message: string, cause?: unknown) {
    super(message, { cause });
  }
}

/** The typed error for a JSON-RPC error object. */
export function errorFromRpc(error: { code?: unknown; message?: unknown; data?: unknown }): RpcError {
  const code = typeof error.code === "number" ? error.code : ErrorCode.InternalError;
  const message = typeof error.message === "string" && error.message ? error.message : `sandboxd error ${code}`;
  switch (code) {
    case ErrorCode.ParseError:
    case ErrorCode.InvalidRequest:
      return new InvalidRequestError(code, message, error.data);
    case ErrorCode.MethodNotFound:
      return new MethodNotFoundError(code, message, error.data);
    case ErrorCode.InvalidParams:
      return new InvalidParamsError(code, message, error.data);
    case ErrorCode.Overloaded:
      return new OverloadedError(code, message, error.data);
    case ErrorCode.BackendUnavailable:
      return new BackendUnavailableError(code, message, error.data);
    case ErrorCode.PeerRefused:
      return new PeerRefusedError(code, message, error.data);
    case ErrorCode.QuotaExceeded:
      return new QuotaExceededError(code, message, error.data);
    case ErrorCode.InternalError:
      return new InternalError(code, message, error.data);
    default:
      return new RpcError(code, message, error.data);
  }
}
