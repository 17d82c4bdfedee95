"""The returns check: an execute that never returns a value, or has a path that ends without a
return (TypeScript's noImplicitReturns). An end that cannot be reached is fine."""

from __future__ import annotations

from collections.abc import Callable

from sandboxd.dev.lint.syntax import FUNCTIONS, RETURN_FIX, Node, node_text, walk


def return_checks(execute: Node, add: Callable[..., None]) -> None:
    """An execute that never returns a value is an error, and so is one with a path that ends without
    a return (TypeScript's noImplicitReturns). An end that cannot be reached (every path returns or
    throws) is fine."""
    body = execute.child_by_field_name("body")
    if body is None or body.type != "statement_block":
        return  # an arrow's expression body is its return value
    if not body.named_children or all(c.type == "comment" for c in body.named_children):
        return  # an empty body is a placeholder (docs/tools.md's own "// Implementation here")
    try:
        completes = _completes(body)
    except RecursionError:  # nesting deeper than Python's stack: say nothing rather than guess
        return
    if not completes:
        return
    returns_value = any(n.type == "return_statement" and len(n.named_children) > 0
                        for n in walk(body, into_functions=False))
    end_line = body.end_point.row + 1
    if not returns_value:
        add(execute, "no-return",
            "execute never returns a ToolResult: it ends without a return, so the agent gets "
            "'execute returned undefined' instead of an answer",
            f"end execute with a return of its result: '{RETURN_FIX}' (or 'return ok(text)')", "error")
    else:
        # An error, not a style point: every call that takes that path fails (often the success path,
        # when the error branches are the ones that return).
        add(execute, "implicit-return",
            "a path through execute reaches its end without a return (TypeScript's noImplicitReturns): every "
            "call that takes it fails with 'execute returned undefined'",
            f"return a result at the end of that path too, e.g. 'return ok(text)' or '{RETURN_FIX}'",
            "error", line=end_line)


def _completes(node: Node) -> bool:
    """Whether running the statement can reach its end (not every path returns or throws)."""
    kind = node.type
    if kind in ("return_statement", "throw_statement"):
        return False
    if kind == "statement_block":
        return _sequence_completes(node.named_children)
    judge = _COMPLETES_BY_KIND.get(kind)
    # A labeled statement, an expression, a declaration...: a labeled break may leave it, so assume it can end.
    return judge(node) if judge is not None else True


def _if_completes(node: Node) -> bool:
    alternative = node.child_by_field_name("alternative")
    if alternative is None:
        return True
    consequence = node.child_by_field_name("consequence")
    other = alternative.named_children[0] if alternative.named_children else None
    return consequence is None or other is None or _completes(consequence) or _completes(other)


def _try_completes(node: Node) -> bool:
    finalizer = node.child_by_field_name("finalizer")
    final_body = finalizer.child_by_field_name("body") if finalizer is not None else None
    if final_body is not None and not _completes(final_body):
        return False
    body = node.child_by_field_name("body")
    handler = node.child_by_field_name("handler")
    handler_body = handler.child_by_field_name("body") if handler is not None else None
    return (body is None or _completes(body)) or (handler_body is not None and _completes(handler_body))


def _switch_completes(node: Node) -> bool:
    body = node.child_by_field_name("body")
    clauses = [c for c in body.named_children if c.type in ("switch_case", "switch_default")] if body else []
    if not any(c.type == "switch_default" for c in clauses) or _breaks_out(node):
        return True
    # Cases fall through, so only the last one's end decides.
    last = clauses[-1]
    value = last.child_by_field_name("value")
    return _sequence_completes([c for c in last.named_children if c != value and c.type != "comment"])


def _loop_completes(node: Node) -> bool:
    condition = node.child_by_field_name("condition")
    endless = condition is None or node_text(condition).strip("(); ") in ("true", "")
    return not endless or _breaks_out(node)


_COMPLETES_BY_KIND: dict[str, Callable[[Node], bool]] = {
    "if_statement": _if_completes, "try_statement": _try_completes, "switch_statement": _switch_completes,
    "while_statement": _loop_completes, "for_statement": _loop_completes, "do_statement": _loop_completes,
}


def _sequence_completes(statements: list[Node]) -> bool:
    return all(_completes(s) for s in statements if s.type != "comment")


def _breaks_out(loop: Node) -> bool:
    """Whether a break inside ``loop`` (not in a nested loop, switch or function) leaves it."""
    nested = FUNCTIONS | {"while_statement", "for_statement", "for_in_statement", "do_statement", "switch_statement"}
    stack = list(loop.named_children)
    while stack:
        node = stack.pop()
        if node.type == "break_statement":
            return True
        if node.type not in nested:
            stack.extend(node.named_children)
    return False
