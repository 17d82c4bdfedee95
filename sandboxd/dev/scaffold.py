"""`sandboxd new`: a new tool folder laid out as docs/tools.md recommends.

The scaffold is a working tool, not a stub: it validates with no findings and
runs, the first time with no arguments: its one example input, ``city``, is
optional with a default. It is there to be renamed; TOOL.md's ``inputs`` and
index.ts's ``Params`` type name it in the two places to edit.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from sandboxd.tools.manifest import MANIFEST_FILE, MAX_NAME_LENGTH, suggest_snake_case

ENTRY_FILE = "index.ts"
_SNAKE_CASE = re.compile(r"[a-z][a-z0-9_]*")

TOOL_MD = """\
---
name: __NAME__
label: __LABEL__
description: Say what __NAME__ does and when the agent should use it, in one or two sentences; the agent reads this to decide when to call the tool.
version: 1
language: typescript
inputs:
  city:
    type: string
    description: An example input, a city name such as Paris. Rename or replace it with what your tool needs.
    optional: true
    default: Paris
---

# __LABEL__

What __NAME__ does, written for the agent: it reads this page to learn how to use the tool.

## Usage

Call with `city`, a city name (Paris when left out). The tool answers with one line of text about it.

## Examples

Look up Paris:
- city: Paris

## Error Handling

When `city` is empty, or the work fails, the tool returns an error result (isError) that says
what went wrong and what to do next.

## Notes

Bump `version` whenever you change this tool, or sync keeps the old copy.
"""

INDEX_TS = """\
// __NAME__: what the agent calls. The loader calls execute() with the inputs declared in
// TOOL.md. Return a ToolResult: the agent sees only what you return, never what you print,
// and of a thrown error only its message, so return err('...') saying what to do instead.

type TextBlock = { type: 'text'; text: string };

type ToolResult = {
  content: TextBlock[];
  isError?: boolean;
};

type OnUpdate = (partial: { content: TextBlock[] }) => void;

// One field per input in TOOL.md (optional inputs with `?`).
type Params = {
  city?: string;
};

function ok(text: string): ToolResult {
  return { content: [{ type: 'text', text }] };
}

function err(text: string): ToolResult {
  return { content: [{ type: 'text', text }], isError: true };
}

export async function execute(
  _toolCallId: string,
  params: Params,
  signal?: AbortSignal,
  onUpdate?: OnUpdate,
): Promise<ToolResult> {
  try {
    // sandboxd fills in TOOL.md's default; `??` keeps execute right where nothing does.
    const city = (params.city ?? 'Paris').trim();
    if (!city) {
      return err('city is empty: pass a city name, e.g. "Paris".');
    }
    // Progress for long work: the agent sees each update as it happens.
    onUpdate?.({ content: [{ type: 'text', text: `Looking up ${city}...` }] });
    if (signal?.aborted) {
      return err('Cancelled before the lookup finished.');
    }
    // The tool's real work goes here; this answer shows the round trip works.
    return ok(`__LABEL__ received city "${city}".`);
  } catch (e) {
    return err(`__LABEL__ failed: ${e instanceof Error ? e.message : String(e)}`);
  }
}
"""


class ScaffoldError(Exception):
    """The tool cannot be created here; the message says why and what to do."""


def check_tool_name(name: str) -> None:
    """Raise ScaffoldError unless ``name`` is a valid tool name (docs/tools.md: snake_case)."""
    if not _SNAKE_CASE.fullmatch(name):
        raise ScaffoldError(f"{name!r} is not a snake_case tool name (lowercase letters, digits and _, starting "
                            f"with a letter); try: sandboxd new {suggest_snake_case(name)}")
    if len(name) > MAX_NAME_LENGTH:
        raise ScaffoldError(f"{name!r} is {len(name)} characters long; model APIs accept tool names of at most "
                            f"{MAX_NAME_LENGTH}: choose a shorter name")


def label_for(name: str) -> str:
    """The display name: "web_search" → "Web Search"."""
    return " ".join(word.capitalize() for word in name.split("_") if word)


def scaffold_tool(name: str, parent: Path) -> list[Path]:
    """Create ``parent/name`` with TOOL.md and index.ts; return the files written."""
    check_tool_name(name)
    target = Path(parent) / name
    if os.path.lexists(target):
        raise ScaffoldError(f"{target} already exists; choose another name or another --dir (nothing was changed)")
    try:
        Path(parent).mkdir(parents=True, exist_ok=True)
        target.mkdir()  # fails if something appeared meanwhile: never write into an existing folder
    except FileExistsError:
        raise ScaffoldError(f"{target} already exists; choose another name or another --dir") from None
    except OSError as exc:
        raise ScaffoldError(f"cannot create {target}: {exc.strerror}; choose a writable --dir") from None
    label = label_for(name)
    written = []
    for filename, template in ((MANIFEST_FILE, TOOL_MD), (ENTRY_FILE, INDEX_TS)):
        path = target / filename
        path.write_text(template.replace("__NAME__", name).replace("__LABEL__", label), encoding="utf-8")
        written.append(path)
    return written
