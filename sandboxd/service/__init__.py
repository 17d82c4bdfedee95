"""Running sandboxd as a system service: systemd integration, peer checks, metrics.

Each module is independent of the daemon's core and is wired in by
``sandboxd.server.server`` and ``sandboxd.cli.serve_cmds``:

- ``systemd``  — sd_notify (READY/RELOADING/STOPPING/WATCHDOG/STATUS) and socket activation;
- ``peercred`` — who is on the other end of a client connection (SO_PEERCRED) and whether they may talk;
- ``metrics``  — Prometheus metrics, served on loopback TCP or a unix socket.
"""
