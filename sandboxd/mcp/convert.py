"""Our protocol's objects as MCP's: tools, results, progress, errors. Pure functions.

- A Tool: TOOL.md `name`, `label` as the title, the description followed by the TOOL.md
  body (what the agent reads to use the tool well), `inputSchema` as is; a permissions block
  as ``openWorldHint`` (it names a network) and whole in ``_meta`` under ``sandboxd/permissions``.
- A result: `content` and `isError` as the tool returned them; `status` and `durationMs`
  in `_meta` under `sandboxd/`. A content block MCP does not know becomes a text block
  saying so, so one odd block never costs the whole answer.
- A daemon error on tools/call: what the model can act on (arguments that fail the
  schema, no sandbox free, Docker down) is a result with `isError`, as MCP asks of tool
  errors; what it cannot (an unknown tool, a server misconfigured) is a JSON-RPC error.
"""

from __future__ import annotations

from typing import Any, Mapping

import mcp_types as types
from pydantic import TypeAdapter, ValidationError

from sandboxd.client import RpcError

INVALID_PARAMS, OVERLOADED, UNAVAILABLE, QUOTA_EXCEEDED = -32602, -32001, -32002, -32004
_BLOCK: TypeAdapter[Any] = TypeAdapter(types.ContentBlock)


def mcp_tool(tool: Mapping[str, Any]) -> types.Tool:
    description = tool.get("description") or ""
    body = (tool.get("documentation") or "").strip()
    if body:
        description = f"{description}\n\n{body}" if description else body
    permissions = tool.get("permissions")
    if not isinstance(permissions, Mapping):  # a tool without the block, or a daemon from before it
        return types.Tool(name=tool["name"], title=tool.get("label") or None, description=description or None,
                          input_schema=tool["inputSchema"])
    # MCP's hint for a tool that reaches outside (the network); the block itself in _meta, as tools/list has it.
    annotations = types.ToolAnnotations(open_world_hint=bool(permissions.get("network")))
    return types.Tool(name=tool["name"], title=tool.get("label") or None, description=description or None,
                      input_schema=tool["inputSchema"], annotations=annotations,
                      _meta={"sandboxd/permissions": dict(permissions)})


def content_blocks(content: Any) -> list[Any]:
    """The tool's content as MCP content blocks; a block MCP cannot carry is described in text."""
    blocks: list[Any] = []
    for block in content if isinstance(content, list) else []:
        try:
            blocks.append(_BLOCK.validate_python(block, by_name=False))
        except ValidationError:
            kind = block.get("type") if isinstance(block, dict) else type(block).__name__
            blocks.append(types.TextContent(text=f"[a {kind!s:.40} content block that MCP cannot carry was left out]"))
    return blocks


def call_result(result: Mapping[str, Any]) -> types.CallToolResult:
    """A daemon tools/call result as MCP's: isError as the daemon says (true for every status but ok)."""
    meta = {"sandboxd/status": result.get("status"), "sandboxd/durationMs": result.get("durationMs")}
    return types.CallToolResult(content=content_blocks(result.get("content")),
                                is_error=bool(result.get("isError", result.get("status") != "ok")), _meta=meta)


def error_result(message: str, status: str) -> types.CallToolResult:
    return types.CallToolResult(content=[types.TextContent(text=message)], is_error=True,
                                _meta={"sandboxd/status": status})


def is_tool_error(exc: RpcError) -> bool:
    """Whether a daemon error on tools/call is the model's to act on (a result), not a protocol error.

    Arguments that fail the schema come with the list of violations as ``data``; an unknown
    tool, a bad user or a forbidden env name (this server's configuration) come without one.
    """
    if exc.code == INVALID_PARAMS:
        return isinstance(exc.data, list)
    return exc.code in (OVERLOADED, UNAVAILABLE, QUOTA_EXCEEDED)  # a full quota: the model can tell the user


def progress_message(params: Mapping[str, Any]) -> tuple[float, str | None]:
    """A daemon progress notification as MCP's (progress, message): the text of its content blocks."""
    progress = params.get("progress")
    texts = [block["text"] for block in params.get("content") or []
             if isinstance(block, dict) and block.get("type") == "text" and isinstance(block.get("text"), str)]
    number = float(progress) if isinstance(progress, (int, float)) and not isinstance(progress, bool) else 0.0
    return number, "\n".join(texts) or None
