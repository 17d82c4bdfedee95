"""sandboxd: runs agents' tools in warm, hardened Node.js sandboxes."""

__version__ = "0.1.0"
