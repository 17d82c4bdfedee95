"""One tools/call, from its request to its answer: admit → check → run → answer.

The dispatcher (rpc.py) owns the request: its id while it is in flight, and the cancel,
the disconnect and the back-pressure that reach its ``CallContext`` meanwhile. Here, one
concern a module, in the order a call meets them:

- ``method``: ``Calls.start`` is the tools/call method: it admits the call (none once the
  daemon stops) and checks its params, and hands the rest to the dispatcher to await;
  ``Calls.answer`` is that rest: a tools scan and the check when the tools changed, then
  the run; the call counts in ``Calls.in_flight`` (what shutdown waits for) until answered;
- ``params``: ``parse_call_params`` checks everything about a call before anything runs;
- ``context``: ``CallContext``, the call in flight: its phase, deadline, cancel grace and
  back-pressure, and the progress it may send;
- ``runner``: ``CallRunner.run`` runs checked params: acquire a sandbox (pool.py) → call
  its shim (the sandbox's backend) → release it, every outcome a result (``sandboxd run``
  runs its calls through it too).

Each phase has one deadline: the queue (pool.acquire_timeout_ms), the call
(timeoutMs, capped), and the cancel grace. A call's future is settled by the
first of: the shim's answer, the sandbox dying, the deadline, or the grace
running out after a cancel; no extra task is created on this hot path.
"""

from sandboxd.server.calls.context import CallContext, Phase
from sandboxd.server.calls.method import Calls
from sandboxd.server.calls.params import CallParams, parse_call_params
from sandboxd.server.calls.runner import CallRunner, result, text

__all__ = ["CallContext", "CallParams", "CallRunner", "Calls", "Phase", "parse_call_params", "result", "text"]
