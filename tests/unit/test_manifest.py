"""TOOL.md parsing: every rule of TOOLS.md "TOOL.md Format", malformed manifests included."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st

from sandboxd.tools.manifest import (
    MAX_MANIFEST_BYTES,
    NO_DEFAULT,
    Input,
    Manifest,
    Problem,
    parse_manifest,
    parse_manifest_text,
    read_version,
    suggest_snake_case,
)
from sandboxd.tools.permissions import NOTHING

REPO = Path(__file__).resolve().parents[2]
PATH = Path("tools/demo/TOOL.md")

SPEC_FRONTMATTER_EXAMPLE = """\
---
name: tool_name
label: Tool Name
description: What the tool does and when the agent should use it.
version: 1
language: typescript
inputs:
  param_name:
    type: string
    description: What this parameter is for.
  optional_param:
    type: number
    description: An optional parameter.
    optional: true
  secret_param:
    type: string
    description: A sensitive value (e.g., API token).
    optional: true
    sensitive: true
  mode:
    type: enum
    values: single,batch
    description: Choose between modes.
---

# Tool Name
"""


def parse(frontmatter: str, body: str = "# Demo\n\nDocs.\n") -> tuple[Manifest | None, list[Problem]]:
    return parse_manifest_text(f"---\n{frontmatter}---\n{body}", PATH)


def manifest_with(extra: str = "", *, head: str = "name: demo\ndescription: Does demo things.\nversion: 1\n",
                  ) -> tuple[Manifest | None, list[Problem]]:
    return parse(head + extra)


def errors(problems: list[Problem]) -> list[Problem]:
    return [p for p in problems if p.severity == "error"]


def only(problems: list[Problem], severity: str = "error") -> Problem:
    assert len(problems) == 1 and problems[0].severity == severity, [str(p) for p in problems]
    return problems[0]


# --- well-formed manifests ---------------------------------------------------------------------


def test_the_quick_start_example_parses_completely() -> None:
    path = REPO / "seed/tools/hello/TOOL.md"
    manifest, problems = parse_manifest(path)
    assert problems == []
    assert manifest == Manifest(
        name="hello",
        label="Hello",
        description="Says hello to the user. Use this when the user wants a greeting.",
        version=1,
        language="typescript",
        inputs=(Input(name="name", type="string", description="Who to greet."),),
        body="# Hello Tool\n\nGreets the user by name.\n\n## Usage\n\n"
             "Call with a `name` parameter to get a personalized greeting.",
        path=path,
        permissions=NOTHING,  # the seed's copy declares that it needs nothing (issue 48); v1: the spec's example
    )


def test_the_spec_frontmatter_example_gives_every_input_property() -> None:
    manifest, problems = parse_manifest_text(SPEC_FRONTMATTER_EXAMPLE, PATH)
    assert problems == []
    assert manifest is not None
    assert manifest.inputs == (
        Input("param_name", "string", "What this parameter is for."),
        Input("optional_param", "number", "An optional parameter.", optional=True),
        Input("secret_param", "string", "A sensitive value (e.g., API token).", optional=True, sensitive=True),
        Input("mode", "enum", "Choose between modes.", values=("single", "batch")),
    )
    assert not any(item.has_default for item in manifest.inputs)


def test_optional_fields_take_their_defaults() -> None:
    manifest, problems = parse("name: demo\ndescription: Does demo things.\nversion: 3\n")
    assert problems == []
    assert manifest is not None
    assert (manifest.label, manifest.language, manifest.inputs, manifest.version) == ("demo", "typescript", (), 3)


@pytest.mark.parametrize("language", ["typescript", "bash", "python"])
def test_each_allowed_language_is_accepted(language: str) -> None:
    manifest, problems = manifest_with(f"language: {language}\n")
    assert problems == [] and manifest is not None and manifest.language == language


def test_the_body_is_kept_without_the_frontmatter() -> None:
    manifest, _ = parse("name: demo\ndescription: D.\nversion: 1\n", body="\n\n# Title\n\n---\n\nMore.\n\n")
    assert manifest is not None
    assert manifest.body == "# Title\n\n---\n\nMore."  # a later --- line is Markdown, not a fence


def test_crlf_and_a_byte_order_mark_read_like_plain_lf() -> None:
    plain = "---\nname: demo\ndescription: Does demo things.\nversion: 2\ninputs:\n  q:\n    type: string\n" \
            "    description: Query.\n---\n# Demo\n\nLine two.\n"
    windows = "\ufeff" + plain.replace("\n", "\r\n")
    assert parse_manifest_text(windows, PATH) == parse_manifest_text(plain, PATH)
    manifest, _ = parse_manifest_text(windows, PATH)
    assert manifest is not None and "\r" not in manifest.body


def test_a_bom_and_crlf_file_on_disk(tmp_path: Path) -> None:
    path = tmp_path / "TOOL.md"
    path.write_bytes(b"\xef\xbb\xbf---\r\nname: demo\r\ndescription: D.\r\nversion: 1\r\n---\r\n# Demo\r\n")
    manifest, problems = parse_manifest(path)
    assert problems == [] and manifest is not None and manifest.body == "# Demo"


# --- required fields ---------------------------------------------------------------------------


def test_missing_name_suggests_one_from_the_directory() -> None:
    manifest, problems = parse_manifest_text("---\ndescription: D.\nversion: 1\n---\n# X\n",
                                             Path("tools/Web-Search/TOOL.md"))
    problem = only(problems)
    assert manifest is None
    assert (problem.field, problem.message) == ("name", "name is required")
    assert "name: web_search" in problem.fix


@pytest.mark.parametrize(("name", "suggestion"), [
    ("WebSearch", "web_search"),
    ("web-search", "web_search"),
    ("Web Search", "web_search"),
    ("HTTPRequest", "http_request"),
    ("2fa", "tool_2fa"),
    ("_private", "private"),
])
def test_a_name_that_is_not_snake_case_is_an_error_with_a_suggestion(name: str, suggestion: str) -> None:
    manifest, problems = manifest_with(head=f"name: {name}\ndescription: D.\nversion: 1\n")
    problem = only(problems)
    assert manifest is None
    assert problem.field == "name" and "snake_case" in problem.message and problem.line == 2
    assert f"name: {suggestion}" in problem.fix


def test_a_name_or_input_name_with_a_trailing_newline_is_refused() -> None:
    _, problems = manifest_with(head='name: "demo\\n"\ndescription: D.\nversion: 1\n')
    assert "not snake_case" in only(problems).message
    _, problems = manifest_with('inputs:\n  "q\\n":\n    type: string\n    description: Q.\n')
    assert "not a valid identifier" in only(problems).message


def test_a_name_longer_than_model_apis_accept_is_an_error() -> None:
    _, problems = manifest_with(head=f"name: {'a' * 65}\ndescription: D.\nversion: 1\n")
    assert "at most 64" in only(problems).message


def test_a_name_that_is_not_a_string_is_an_error() -> None:
    _, problems = manifest_with(head="name: 42\ndescription: D.\nversion: 1\n")
    problem = only(problems)
    assert "name must be a string" in problem.message and "tool_42" in problem.fix


@pytest.mark.parametrize("description", ["", "''", "'   '", "[a, b]"])
def test_description_must_be_non_empty_text(description: str) -> None:
    manifest, problems = manifest_with(head=f"name: demo\ndescription: {description}\nversion: 1\n")
    assert manifest is None and only(problems).field == "description"


def test_missing_description_is_an_error() -> None:
    _, problems = manifest_with(head="name: demo\nversion: 1\n")
    assert only(problems).message == "description is required"


# --- version -----------------------------------------------------------------------------------


def test_missing_version_is_zero_with_a_warning_about_sync() -> None:
    manifest, problems = manifest_with(head="name: demo\ndescription: D.\n")
    problem = only(problems, "warning")
    assert manifest is not None and manifest.version == 0
    assert problem.field == "version" and "sync will never update" in problem.message
    assert "version: 1" in problem.fix


@pytest.mark.parametrize(("value", "shown"), [('"2"', '"2"'), ("true", "true"), ("1.5", "1.5"), ("[1]", "a list")])
def test_version_must_be_an_integer(value: str, shown: str) -> None:
    manifest, problems = manifest_with(head=f"name: demo\ndescription: D.\nversion: {value}\n")
    problem = only(problems)
    assert manifest is None
    assert problem.message == f"version must be an integer, got {shown}"
    assert problem.line == 4


def test_a_quoted_version_gets_the_unquoted_spelling_as_fix() -> None:
    _, problems = manifest_with(head="name: demo\ndescription: D.\nversion: '7'\n")
    assert "version: 7" in only(problems).fix


# --- language and unknown keys ----------------------------------------------------------------


def test_an_unknown_language_lists_the_allowed_ones() -> None:
    _, problems = manifest_with("language: rust\n")
    problem = only(problems)
    assert "typescript, bash, python" in problem.message and 'got "rust"' in problem.message


def test_a_capitalised_language_is_an_error_whose_fix_is_lowercase() -> None:
    _, problems = manifest_with("language: Python\n")
    assert "language: python" in only(problems).fix


def test_unknown_top_level_keys_are_warnings_with_spelling_help() -> None:
    manifest, problems = manifest_with("author: me\nlable: Demo\n")
    assert manifest is not None
    assert [(p.field, p.severity) for p in problems] == [("author", "warning"), ("lable", "warning")]
    assert "label" in problems[1].fix


# --- inputs ------------------------------------------------------------------------------------


def input_problems(spec: str) -> tuple[Manifest | None, list[Problem]]:
    return manifest_with("inputs:\n" + spec)


@pytest.mark.parametrize("kind", ["object", "array"])
def test_object_and_array_inputs_are_not_supported(kind: str) -> None:
    manifest, problems = input_problems(f"  data:\n    type: {kind}\n    description: Data.\n")
    problem = only(problems)
    assert manifest is None
    assert problem.field == "inputs.data.type"
    assert "not supported: accept a JSON string and parse it in execute" in problem.message
    assert "JSON.parse(params.data)" in problem.fix


@pytest.mark.parametrize(("kind", "fix"), [("integer", "type: number"), ("String", "type: string"),
                                           ("date", "string, number, boolean, enum")])
def test_an_unknown_type_becomes_string_with_a_warning(kind: str, fix: str) -> None:
    manifest, problems = input_problems(f"  when:\n    type: {kind}\n    description: When.\n")
    problem = only(problems, "warning")
    assert manifest is not None and manifest.inputs[0].type == "string"
    assert problem.field == "inputs.when.type" and fix in problem.fix


def test_an_integer_input_with_a_number_default_is_one_warning_with_the_right_fix() -> None:
    """Issue 29: `type: integer` + `default: 5` said "use type: number", then wrongly "quote the default"."""
    manifest, problems = input_problems("  count:\n    type: integer\n    description: How many.\n    default: 5\n")
    problem = only(problems, "warning")
    assert manifest is not None and manifest.inputs[0].type == "string" and not manifest.inputs[0].has_default
    assert problem.message == "unknown type 'integer' is treated as string, so its default 5 is ignored"
    assert problem.fix == "use 'type: number'"


def test_an_input_without_type_or_description_is_an_error_for_each() -> None:
    manifest, problems = input_problems("  q:\n    optional: true\n")
    assert manifest is None
    assert [p.field for p in problems] == ["inputs.q.type", "inputs.q.description"]


def test_an_input_given_as_a_bare_type_explains_the_mapping() -> None:
    _, problems = input_problems("  q: string\n")
    problem = only(problems)
    assert "must be a mapping with type and description" in problem.message and "type: string" in problem.fix


def test_inputs_must_be_a_mapping() -> None:
    _, problems = manifest_with("inputs:\n  - q\n")
    assert only(problems).field == "inputs"


@pytest.mark.parametrize("values", ["single,batch", "' single , batch '", "[single, batch]", "\n      - single\n      - batch"])
def test_enum_values_as_comma_separated_string_or_yaml_list(values: str) -> None:
    manifest, problems = input_problems(f"  mode:\n    type: enum\n    description: Mode.\n    values: {values}\n")
    assert problems == [] and manifest is not None
    assert manifest.inputs[0].values == ("single", "batch")


def test_enum_values_that_yaml_1_1_would_turn_into_booleans_stay_text() -> None:
    manifest, problems = input_problems("  answer:\n    type: enum\n    description: A.\n    values: [yes, no, on, 3]\n")
    assert problems == [] and manifest is not None
    assert manifest.inputs[0].values == ("yes", "no", "on", "3")


def test_an_enum_without_values_is_an_error() -> None:
    manifest, problems = input_problems("  mode:\n    type: enum\n    description: Mode.\n")
    problem = only(problems)
    assert manifest is None and problem.field == "inputs.mode.values" and "values: a,b,c" in problem.fix


@pytest.mark.parametrize(("values", "message"), [
    ("a,,b", "values has an empty item"),
    ("'a,b,'", "values has an empty item"),
    ("[]", "values is empty"),
    ("[a, [b]]", "each value must be text, got a list"),
    ("{a: 1}", "values must be a comma-separated string or a YAML list, got a mapping"),
])
def test_malformed_enum_values_are_errors(values: str, message: str) -> None:
    manifest, problems = input_problems(f"  mode:\n    type: enum\n    description: Mode.\n    values: {values}\n")
    assert manifest is None and only(problems).message == message


def test_a_repeated_enum_value_is_a_warning_and_kept_once() -> None:
    manifest, problems = input_problems("  mode:\n    type: enum\n    description: M.\n    values: a,b,a\n")
    assert only(problems, "warning").field == "inputs.mode.values"
    assert manifest is not None and manifest.inputs[0].values == ("a", "b")


def test_values_on_a_non_enum_input_are_ignored_with_a_warning() -> None:
    manifest, problems = input_problems("  q:\n    type: string\n    description: Q.\n    values: a,b\n")
    assert only(problems, "warning").message.startswith("values is only used by type: enum")
    assert manifest is not None and manifest.inputs[0].values is None


@pytest.mark.parametrize("key", ["optional", "sensitive"])
@pytest.mark.parametrize("value", ['"true"', "yes", "1"])
def test_optional_and_sensitive_must_be_booleans(key: str, value: str) -> None:
    manifest, problems = input_problems(f"  q:\n    type: string\n    description: Q.\n    {key}: {value}\n")
    problem = only(problems)
    assert manifest is None and problem.field == f"inputs.q.{key}" and "true or false" in problem.message


@pytest.mark.parametrize(("kind", "default", "expected"), [
    ("string", "hello", "hello"),
    ("string", "''", ""),
    ("number", "10", 10),
    ("number", "1e3", 1000.0),
    ("number", "0.5", 0.5),
    ("boolean", "false", False),
])
def test_a_default_of_the_inputs_type_is_kept(kind: str, default: str, expected: object) -> None:
    manifest, problems = input_problems(
        f"  q:\n    type: {kind}\n    description: Q.\n    optional: true\n    default: {default}\n")
    assert problems == [] and manifest is not None
    item = manifest.inputs[0]
    assert item.has_default and item.default == expected and type(item.default) is type(expected)


def test_no_default_is_distinct_from_every_value() -> None:
    manifest, _ = input_problems("  q:\n    type: string\n    description: Q.\n")
    assert manifest is not None
    item = manifest.inputs[0]
    assert item.default is NO_DEFAULT and not item.has_default
    assert Input("q", "string", "Q.", default=None).has_default


def test_an_empty_default_is_ignored_with_a_warning() -> None:
    manifest, problems = input_problems("  q:\n    type: string\n    description: Q.\n    default:\n")
    assert only(problems, "warning").field == "inputs.q.default"
    assert manifest is not None and not manifest.inputs[0].has_default


@pytest.mark.parametrize(("kind", "default", "fix"), [
    ("number", '"5"', "default: 5"),
    ("number", "many", "give a number"),
    ("boolean", '"true"', "default: true"),
    ("string", "5", 'default: "5"'),
    ("string", "2024-01-01", 'default: "2024-01-01"'),
])
def test_a_default_of_another_type_is_an_error(kind: str, default: str, fix: str) -> None:
    manifest, problems = input_problems(f"  q:\n    type: {kind}\n    description: Q.\n    default: {default}\n")
    problem = only(problems)
    assert manifest is None and problem.field == "inputs.q.default" and fix in problem.fix


def test_an_enum_default_must_be_one_of_the_values() -> None:
    _, problems = input_problems("  mode:\n    type: enum\n    description: M.\n    values: a,b\n    default: c\n")
    problem = only(problems)
    assert "not one of the values" in problem.message and "a, b" in problem.fix


@pytest.mark.parametrize("name", ["max results", "max-results", "1st"])
def test_input_names_must_be_identifiers(name: str) -> None:
    manifest, problems = input_problems(f"  '{name}':\n    type: string\n    description: Q.\n")
    problem = only(problems)
    assert manifest is None and "not a valid identifier" in problem.message


def test_an_input_name_that_yaml_reads_as_a_number_is_an_error() -> None:
    _, problems = input_problems("  1:\n    type: string\n    description: Q.\n")
    assert "is not text" in only(problems).message


def test_unknown_input_keys_are_warnings_and_required_is_explained() -> None:
    manifest, problems = input_problems("  q:\n    type: string\n    description: Q.\n    required: true\n")
    problem = only(problems, "warning")
    assert manifest is not None and "optional: true" in problem.fix


# --- syntax and structure ----------------------------------------------------------------------


def test_no_frontmatter_is_reported() -> None:
    manifest, problems = parse_manifest_text("# Just Markdown\n", PATH)
    problem = only(problems)
    assert manifest is None
    assert problem.message == "no YAML frontmatter; start TOOL.md with --- ... ---" and problem.line == 1


def test_frontmatter_after_a_blank_line_says_it_must_start_on_line_one() -> None:
    _, problems = parse_manifest_text("\n---\nname: demo\n---\n", PATH)
    assert "line 1" in only(problems).fix


def test_an_unclosed_frontmatter_is_reported() -> None:
    manifest, problems = parse_manifest_text("---\nname: demo\ndescription: D.\n", PATH)
    assert manifest is None and "never closed" in only(problems).message


def test_a_yaml_syntax_error_gives_the_line_in_the_file() -> None:
    text = "---\nname: demo\ndescription: D.\nversion: 1\ninputs: [unclosed\n---\n# Demo\n"
    manifest, problems = parse_manifest_text(text, PATH)
    problem = only(problems)
    assert manifest is None and problem.message.startswith("YAML syntax error")
    assert problem.line == 5


def test_a_colon_in_an_unquoted_value_points_at_its_line() -> None:
    text = "---\nname: demo\ndescription: Use it: carefully\nversion: 1\n---\n"
    problem = only(parse_manifest_text(text, PATH)[1])
    assert problem.line == 3 and "quote" in problem.fix


def test_a_duplicated_key_is_an_error_as_in_javascript_loaders() -> None:
    _, problems = parse("name: demo\ndescription: D.\nversion: 1\nversion: 2\n")
    problem = only(problems)
    assert "duplicated key 'version'" in problem.message and problem.line == 5


def test_a_control_character_is_reported_with_its_line() -> None:
    problem = only(parse("name: demo\ndescription: a\x1fb\nversion: 1\n")[1])
    assert "#x001f" in problem.message and problem.line == 3


def test_an_impossible_date_is_reported_not_raised() -> None:
    _, problems = parse("name: demo\ndescription: 2024-13-45\nversion: 1\n")
    assert only(problems).message.startswith("YAML error")


@pytest.mark.parametrize("frontmatter", ["- a\n- b\n", "just text\n", "42\n"])
def test_frontmatter_that_is_not_a_mapping_is_an_error(frontmatter: str) -> None:
    manifest, problems = parse(frontmatter)
    assert manifest is None and "must be a mapping" in only(problems).message


def test_an_empty_frontmatter_reports_the_required_keys() -> None:
    _, problems = parse("")
    assert {p.message for p in errors(problems)} == {"name is required", "description is required"}


def test_a_missing_body_is_a_warning() -> None:
    manifest, problems = parse("name: demo\ndescription: D.\nversion: 1\n", body="\n")
    assert manifest is not None and "no documentation" in only(problems, "warning").message


def test_every_problem_is_reported_at_once_in_file_order() -> None:
    text = """---
name: Bad Name
version: "2"
language: rust
colour: blue
inputs:
  mode:
    type: enum
    description: Mode.
  data:
    type: object
    description: Data.
  n:
    type: number
    description: N.
    optional: maybe
---
"""
    manifest, problems = parse_manifest_text(text, PATH)
    assert manifest is None
    assert [(p.field, p.severity) for p in problems] == [
        ("description", "error"),
        (None, "warning"),  # no body
        ("name", "error"),
        ("version", "error"),
        ("language", "error"),
        ("colour", "warning"),
        ("inputs.mode.values", "error"),
        ("inputs.data.type", "error"),
        ("inputs.n.optional", "error"),
    ]
    assert [p.line for p in problems][2:] == [2, 3, 4, 5, 7, 11, 16]


# --- Problem -----------------------------------------------------------------------------------


def test_a_problem_prints_as_one_line_with_place_field_and_fix() -> None:
    problem = Problem(Path("t/TOOL.md"), "version must be an integer", "write version: 2", "version", 3)
    assert str(problem) == "t/TOOL.md:3: error: version: version must be an integer. Fix: write version: 2"
    warning = Problem(Path("t/TOOL.md"), "no body.", "add one.", severity="warning")
    assert str(warning) == "t/TOOL.md: warning: no body. Fix: add one"


def test_suggest_snake_case_of_nothing_usable() -> None:
    assert suggest_snake_case("!!!") == "my_tool"


# --- files ---------------------------------------------------------------------------------------


def test_a_missing_file_is_a_problem(tmp_path: Path) -> None:
    manifest, problems = parse_manifest(tmp_path / "TOOL.md")
    assert manifest is None and "does not exist" in only(problems).message


def test_a_file_that_is_not_utf8_names_the_line(tmp_path: Path) -> None:
    path = tmp_path / "TOOL.md"
    path.write_bytes(b"---\nname: demo\ndescription: caf\xe9\n---\n")
    problem = only(parse_manifest(path)[1])
    assert "not UTF-8" in problem.message and problem.line == 3


def test_a_fifo_is_refused_without_blocking(tmp_path: Path) -> None:
    path = tmp_path / "TOOL.md"
    os.mkfifo(path)
    assert "not a regular file" in only(parse_manifest(path)[1]).message


def test_an_oversized_file_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "TOOL.md"
    path.write_text("---\nname: demo\ndescription: D.\n---\n" + "x" * MAX_MANIFEST_BYTES)
    assert "over the limit" in only(parse_manifest(path)[1]).message


def test_within_refuses_a_file_that_resolves_outside(tmp_path: Path) -> None:
    outside = tmp_path / "secret.md"
    outside.write_text("---\nname: demo\ndescription: D.\nversion: 1\n---\n# Secret\n")
    root = tmp_path / "tools"
    (root / "demo").mkdir(parents=True)
    (root / "demo" / "TOOL.md").symlink_to(outside)
    manifest, problems = parse_manifest(root / "demo" / "TOOL.md", within=root)
    assert manifest is None and "outside the tools directory" in only(problems).message
    assert parse_manifest(root / "demo" / "TOOL.md")[0] is not None  # without within it is just a file


# --- read_version --------------------------------------------------------------------------------


@pytest.mark.parametrize(("content", "version"), [
    ("---\nname: a\nversion: 4\n---\n", 4),
    ("\ufeff---\r\nversion: 5\r\n---\r\n", 5),
    ("---\nname: a\n---\n", 0),
    ("---\nversion: '2'\n---\n", 0),
    ("---\nversion: true\n---\n", 0),
    ("---\nversion: [\n---\n", 0),
    ("---\n- 1\n---\n", 0),
    ("no frontmatter\n", 0),
    ("---\nversion: 3\n", 0),
])
def test_read_version(tmp_path: Path, content: str, version: int) -> None:
    path = tmp_path / "TOOL.md"
    path.write_text(content, encoding="utf-8")
    assert read_version(path) == version


def test_read_version_of_a_missing_file_is_zero(tmp_path: Path) -> None:
    assert read_version(tmp_path / "TOOL.md") == 0


# --- never raises --------------------------------------------------------------------------------

_yaml_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3),
    max_leaves=12,
)


@settings(max_examples=300, deadline=None, database=None)
@given(st.text(max_size=300))
def test_arbitrary_text_never_raises(text: str) -> None:
    for candidate in (text, "---\n" + text + "\n---\n"):
        manifest, problems = parse_manifest_text(candidate, PATH)
        assert manifest is not None or any(p.severity == "error" for p in problems)


@settings(max_examples=300, deadline=None, database=None)
@given(st.dictionaries(st.sampled_from(["name", "description", "version", "label", "language", "inputs", "x"]),
                       _yaml_values, max_size=6),
       st.dictionaries(st.text(max_size=6),
                       st.dictionaries(st.sampled_from(["type", "description", "optional", "sensitive", "values",
                                                        "default", "y"]), _yaml_values, max_size=5),
                       max_size=3))
def test_arbitrary_frontmatter_never_raises(data: dict, inputs: dict) -> None:
    data = {**data, "inputs": inputs} if inputs else data
    manifest, problems = parse("" if not data else yaml.safe_dump(data))
    if manifest is None:
        assert any(p.severity == "error" for p in problems)
    else:
        assert all(p.severity == "warning" for p in problems)


# --- hostile YAML: a user's TOOL.md is written by that user's sandboxes -----------------------


def yaml_bomb(levels: int = 8) -> str:
    """The ~600-byte manifest of issue 11: nested aliases as an input's default (9**levels items)."""
    lines = ["name: bomb", "description: Boom.", "version: 1", "inputs:", "  q:", "    type: string",
             "    description: Q.", "    default:", "      - &a0 [x, x, x, x, x, x, x, x, x]"]
    lines += [f"      - &a{i} [" + ", ".join([f"*a{i - 1}"] * 9) + "]" for i in range(1, levels)]
    return "\n".join(lines) + "\n"


def test_anchors_and_aliases_are_refused_so_a_yaml_bomb_costs_nothing() -> None:
    import time

    text = yaml_bomb()
    assert len(text.encode()) < 700
    started = time.monotonic()
    manifest, problems = parse(text)
    assert time.monotonic() - started < 1.0  # str() of the expanded default alone took minutes
    problem = only(problems)
    assert manifest is None and "anchors and aliases" in problem.message and problem.line == 10
    assert "&name" in problem.fix


def test_a_single_anchor_is_refused_too() -> None:
    problem = only(manifest_with("label: &l Demo\n")[1])
    assert "anchors and aliases" in problem.message


def test_read_version_refuses_aliases() -> None:
    assert read_version_of("---\nversion: &v 3\n---\n") == 0


def read_version_of(text: str) -> int:
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "TOOL.md"
        path.write_text(text)
        return read_version(path)


def test_nesting_deeper_than_the_limit_is_refused() -> None:
    from sandboxd.tools.yaml12 import MAX_YAML_DEPTH

    problem = only(manifest_with("label: " + "[" * (MAX_YAML_DEPTH + 5) + "]" * (MAX_YAML_DEPTH + 5) + "\n")[1])
    assert f"nested more than {MAX_YAML_DEPTH} levels" in problem.message


def test_more_nodes_than_the_limit_are_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    from sandboxd.tools import yaml12
    from sandboxd.tools.yaml12 import MAX_YAML_NODES

    # The count is under test, not the clock: a loaded machine took over 2 s to read 10,001 values.
    monkeypatch.setattr(yaml12, "PARSE_TIME_LIMIT_S", 60.0)
    problem = only(manifest_with("label: [" + ",".join(["1"] * (MAX_YAML_NODES + 1)) + "]\n")[1])
    assert f"more than {MAX_YAML_NODES} values" in problem.message


def test_a_frontmatter_over_the_size_limit_is_refused_before_parsing() -> None:
    from sandboxd.tools.manifest import MAX_FRONTMATTER_BYTES

    problem = only(manifest_with("label: " + "x" * MAX_FRONTMATTER_BYTES + "\n")[1])
    assert "over the limit" in problem.message and "Markdown body" in problem.fix


def test_a_parse_past_the_time_limit_stops_with_a_problem(monkeypatch: pytest.MonkeyPatch) -> None:
    from sandboxd.tools import yaml12

    monkeypatch.setattr(yaml12, "PARSE_TIME_LIMIT_S", -1.0)  # every node is past the deadline
    manifest, problems = manifest_with()
    problem = only(problems)
    assert manifest is None and "took longer than" in problem.message and "skipped" in problem.message


def test_a_list_default_for_a_string_input_is_reported_without_printing_it() -> None:
    manifest, problems = manifest_with("inputs:\n  q:\n    type: string\n    description: Q.\n"
                                       "    default: [" + ", ".join(["x" * 50] * 50) + "]\n")
    problem = only(problems)
    assert "got a list" in problem.message and len(problem.fix) < 100


def test_a_tool_md_fifo_is_never_opened(tmp_path: Path) -> None:
    """Not even for a moment: a writer waiting on the FIFO would see a reader appear."""
    import threading

    path = tmp_path / "TOOL.md"
    os.mkfifo(path)
    opened = threading.Event()

    def writer() -> None:
        fd = os.open(path, os.O_WRONLY)  # blocks until someone opens the FIFO for reading
        opened.set()
        os.close(fd)

    thread = threading.Thread(target=writer, daemon=True)
    thread.start()
    assert "not a regular file" in only(parse_manifest(path)[1]).message
    assert not opened.wait(0.5), "parse_manifest opened the FIFO"
    os.close(os.open(path, os.O_RDONLY | os.O_NONBLOCK))  # let the writer go
    thread.join(5)


def test_a_tool_md_linked_to_a_device_is_refused(tmp_path: Path) -> None:
    root = tmp_path / "tools"
    (root / "demo").mkdir(parents=True)
    (root / "demo" / "TOOL.md").symlink_to("/dev/zero")
    problem = only(parse_manifest(root / "demo" / "TOOL.md", within=root)[1])
    assert "not a regular file" in problem.message
