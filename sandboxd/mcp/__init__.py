"""`sandboxd mcp`: one user's tools for any MCP host, as a client of the running daemon (docs/mcp.md)."""
