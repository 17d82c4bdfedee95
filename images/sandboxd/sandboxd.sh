#!/bin/sh
# The `sandboxd` command in the daemon image: the package lives in PYTHONPATH, not a venv.
exec python3 -m sandboxd "$@"
