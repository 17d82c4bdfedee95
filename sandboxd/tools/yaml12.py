"""PyYAML's safe loader switched to the YAML 1.2 core schema, as pi's JavaScript loaders read TOOL.md.

Only ``true``/``false`` are booleans (``yes``, ``on``, ``no`` stay text), ``1e3`` is a
number, ``010`` is ten, and a key given twice is an error. A user's TOOL.md is hostile
input (its sandboxes write it): anchors and aliases (the "billion laughs" expansion) are
refused, and depth, nodes and time are bounded (checked at every node).
"""

from __future__ import annotations

import re
import time
from typing import Any

import yaml

MAX_YAML_DEPTH = 16  # a manifest needs 5: inputs → input → values → value
MAX_YAML_NODES = 10_000
PARSE_TIME_LIMIT_S = 2.0


class ManifestLoader(yaml.SafeLoader):
    """PyYAML's safe loader switched to the YAML 1.2 core schema, refusing duplicate keys.

    It also refuses anchors and aliases and bounds depth, nodes and time (the module's docstring).
    """

    def __init__(self, stream: str) -> None:
        super().__init__(stream)
        self._depth = 0
        self._nodes = 0
        self._deadline = time.monotonic() + PARSE_TIME_LIMIT_S

    def compose_node(self, parent: yaml.Node | None, index: Any) -> yaml.Node:
        event = self.peek_event()
        if isinstance(event, yaml.AliasEvent) or event.anchor is not None:
            raise Refused("anchors and aliases (&name, *name) are not allowed in TOOL.md",
                          "write each value out in full instead of '&name' and '*name'", event.start_mark)
        self._nodes += 1
        if self._nodes > MAX_YAML_NODES:
            raise Refused(f"the frontmatter has more than {MAX_YAML_NODES} values",
                          "keep the frontmatter to metadata and inputs", event.start_mark)
        if self._depth >= MAX_YAML_DEPTH:
            raise Refused(f"the frontmatter is nested more than {MAX_YAML_DEPTH} levels deep",
                          "a manifest needs inputs → input → values at most; flatten the rest", event.start_mark)
        if time.monotonic() > self._deadline:
            raise ParseTimeout(f"reading the frontmatter took longer than {PARSE_TIME_LIMIT_S:g} s")
        self._depth += 1
        try:
            node = super().compose_node(parent, index)
            assert node is not None  # pyyaml types it Optional; a composed node always is one
            return node
        finally:
            self._depth -= 1

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: set[tuple[str, str]] = set()
        for key_node, _ in node.value:
            if isinstance(key_node, yaml.ScalarNode) and key_node.value != "<<":
                key = (key_node.tag, key_node.value)
                if key in seen:
                    raise yaml.constructor.ConstructorError(
                        None, None, f"duplicated key {key_node.value!r}", key_node.start_mark)
                seen.add(key)
        return super().construct_mapping(node, deep=deep)

    def construct_yaml_int(self, node: yaml.ScalarNode) -> int:
        text = self.construct_scalar(node)
        if text.startswith(("0o", "0x")):
            return int(text[2:], 8 if text[1] == "o" else 16)
        return int(text)  # "010" is ten in YAML 1.2, not eight


_YAML_1_1_TAGS = {"tag:yaml.org,2002:bool", "tag:yaml.org,2002:int", "tag:yaml.org,2002:float"}
ManifestLoader.yaml_implicit_resolvers = {
    first: [(tag, regexp) for tag, regexp in resolvers if tag not in _YAML_1_1_TAGS]
    for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()
}
ManifestLoader.add_implicit_resolver(
    "tag:yaml.org,2002:bool", re.compile(r"^(?:true|True|TRUE|false|False|FALSE)$"), list("tTfF"))
ManifestLoader.add_implicit_resolver(
    "tag:yaml.org,2002:int", re.compile(r"^(?:[-+]?[0-9]+|0o[0-7]+|0x[0-9a-fA-F]+)$"), list("-+0123456789"))
ManifestLoader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^(?:[-+]?(?:\.[0-9]+|[0-9]+(?:\.[0-9]*)?)(?:[eE][-+]?[0-9]+)?"
               r"|[-+]?\.(?:inf|Inf|INF)|\.(?:nan|NaN|NAN))$"),
    list("-+.0123456789"))
ManifestLoader.add_constructor("tag:yaml.org,2002:int", ManifestLoader.construct_yaml_int)


class ParseTimeout(yaml.YAMLError):
    """A parse ran out of time: the tool is skipped with a problem saying so."""


class Refused(yaml.composer.ComposerError):
    """YAML that TOOL.md does not allow (anchors, too deep, too many nodes), with its fix."""

    def __init__(self, problem: str, fix: str, mark: yaml.Mark) -> None:
        super().__init__(None, None, problem, mark)
        self.fix = fix
