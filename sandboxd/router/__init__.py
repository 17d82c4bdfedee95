"""`sandboxd router`: one unix socket in front of every host (docs/scale.md, "The router")."""
