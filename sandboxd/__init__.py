"""sandboxd: runs agents' tools in warm, hardened Node.js sandboxes."""

# One version for the daemon and the runner image it runs (images/node/VERSION): they are
# released together, and a test keeps the two equal. pyproject.toml reads it from here.
__version__ = "0.6.0"
