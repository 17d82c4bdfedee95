"""The Docker backend: one hardened container per sandbox, its shim on a unix socket.

One concern a module, in the order a sandbox meets them: ``runtime`` (is the engine's
runtime usable: runc, gVisor), ``spec`` (the container's flags, a pure function) with
``seccomp`` (runc's syscall filter), ``esbuild`` (the transpiler copied out of the image),
``sockets`` (the sandbox's socket directory and who may connect), ``attach`` (the attach
stream's frames), ``sandbox`` (one running sandbox's connections), ``exits`` (the words
that say why it ended); ``backend`` is what talks to the engine.
"""

from sandboxd.sandbox.docker.backend import DockerBackend

__all__ = ["DockerBackend"]
