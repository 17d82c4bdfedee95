"""sandbox.runtime against the engine's registered runtimes: what stops start-up, and how it says so."""

from __future__ import annotations

from typing import Any

from sandboxd.sandbox.docker.runtime import is_gvisor, runtime_problem

GOOD = {"path": "/usr/bin/runsc", "runtimeArgs": ["--platform=ptrace", "--network=none", "--host-uds=open"]}


def info(**runtimes: Any) -> dict[str, Any]:
    return {"Runtimes": {"runc": {"path": "runc"}, **runtimes}}


def test_no_runtime_or_runc_needs_nothing() -> None:
    assert runtime_problem(info(), None, local=True) is None
    assert runtime_problem(info(), "runc", local=True) is None
    assert not is_gvisor(info(), None) and not is_gvisor(info(), "runc")


def test_runsc_registered_with_the_flags_passes_and_is_gvisor_under_any_name() -> None:
    assert runtime_problem(info(runsc=GOOD), "runsc", local=False) is None
    assert is_gvisor(info(gvisor=GOOD), "gvisor")
    assert runtime_problem(info(gvisor={**GOOD, "runtimeArgs": ["-network=none", "-host-uds=all"]}), "gvisor",
                           local=False) is None


def test_runsc_unknown_to_the_engine_names_the_fix() -> None:
    problem = runtime_problem(info(), "runsc", local=True)
    assert problem == ("sandbox.runtime is 'runsc', which the Docker engine does not know; run `sudo make gvisor` "
                       "(scripts/ensure-gvisor.sh; docs/install.md, \"gVisor\")")
    assert "register it in the engine's daemon.json" in (runtime_problem(info(), "kata", local=True) or "")


def test_runsc_registered_but_not_installed_names_the_fix() -> None:
    problem = runtime_problem(info(runsc={**GOOD, "path": "/nonexistent/runsc"}), "runsc", local=True)
    assert problem is not None and "registered with the Docker engine as /nonexistent/runsc, which is not on this host" in problem
    assert "sudo make gvisor" in problem
    # a remote engine's binary is not looked for here
    assert runtime_problem(info(runsc={**GOOD, "path": "/nonexistent/runsc"}), "runsc", local=False) is None


def test_runsc_without_the_flags_sandboxd_needs_says_which() -> None:
    bare = {"path": "/usr/bin/runsc", "runtimeArgs": ["--platform=ptrace"]}
    problem = runtime_problem(info(runsc=bare), "runsc", local=False)
    assert problem is not None
    assert "registered without --network=none --host-uds=open, which sandboxd needs" in problem
    assert "sudo make gvisor" in problem
    only_network = {**bare, "runtimeArgs": ["--network=none", "--host-uds=create"]}
    assert "without --host-uds=open," in (runtime_problem(info(runsc=only_network), "runsc", local=False) or "")
