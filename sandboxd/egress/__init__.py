"""Egress: sandboxes have no network of their own; the daemon's proxy is their only way out."""
