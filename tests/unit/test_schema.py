"""inputSchema as PROTOCOL.md describes it, and argument checking with AJV's coercion."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest

from sandboxd.errors import InvalidParams
from sandboxd.tools.manifest import Input, Manifest, parse_manifest_text
from sandboxd.tools.schema import input_schema, js_number_to_string, sensitive_names, validate_arguments


def manifest(*inputs: Input) -> Manifest:
    return Manifest(name="demo", label="Demo", description="D.", version=1, language="typescript",
                    inputs=inputs, body="", path=Path("TOOL.md"))


SPEC_EXAMPLE = manifest(
    Input("param_name", "string", "What this parameter is for."),
    Input("optional_param", "number", "An optional parameter.", optional=True),
    Input("secret_param", "string", "A sensitive value (e.g., API token).", optional=True, sensitive=True),
    Input("mode", "enum", "Choose between modes.", values=("single", "batch")),
)


# --- input_schema ------------------------------------------------------------------------------


def test_the_spec_example_schema() -> None:
    assert input_schema(SPEC_EXAMPLE) == {
        "type": "object",
        "properties": {
            "param_name": {"type": "string", "description": "What this parameter is for."},
            "optional_param": {"type": "number", "description": "An optional parameter."},
            "secret_param": {"type": "string", "description": "A sensitive value (e.g., API token).",
                             "writeOnly": True},
            "mode": {"type": "string", "enum": ["single", "batch"], "description": "Choose between modes."},
        },
        "required": ["param_name", "mode"],
        "additionalProperties": False,
    }


def test_keys_come_in_a_stable_readable_order() -> None:
    item = Input("mode", "enum", "M.", optional=True, sensitive=True, values=("a",), default="a")
    schema = input_schema(manifest(item))
    assert list(schema) == ["type", "properties", "required", "additionalProperties"]
    assert list(schema["properties"]["mode"]) == ["type", "enum", "description", "default", "writeOnly"]


def test_required_follows_manifest_order_and_stays_when_empty() -> None:
    schema = input_schema(manifest(Input("b", "string", "B."), Input("a", "string", "A.")))
    assert schema["required"] == ["b", "a"]
    assert input_schema(manifest()) == {"type": "object", "properties": {}, "required": [],
                                        "additionalProperties": False}


@pytest.mark.parametrize("default", ["x", 0, 2.5, False, None])
def test_defaults_carry_over_including_falsy_ones(default: Any) -> None:
    kind = {str: "string", int: "number", float: "number", bool: "boolean"}.get(type(default), "string")
    schema = input_schema(manifest(Input("q", kind, "Q.", optional=True, default=default)))
    assert schema["properties"]["q"]["default"] == default
    assert "default" not in input_schema(manifest(Input("q", kind, "Q.")))["properties"]["q"]


def test_an_unknown_type_in_the_manifest_becomes_a_string_schema() -> None:
    parsed, _ = parse_manifest_text(
        "---\nname: demo\ndescription: D.\nversion: 1\ninputs:\n  when:\n    type: date\n    description: W.\n---\n",
        Path("TOOL.md"))
    assert parsed is not None
    assert input_schema(parsed)["properties"]["when"] == {"type": "string", "description": "W."}


def test_sensitive_names() -> None:
    assert sensitive_names(input_schema(SPEC_EXAMPLE)) == {"secret_param"}
    assert sensitive_names({"type": "object"}) == set()


# --- coercion, as AJV 8 with coerceTypes: true does it -----------------------------------------

NUMBER = input_schema(manifest(Input("n", "number", "N.")))
STRING = input_schema(manifest(Input("s", "string", "S.")))
BOOLEAN = input_schema(manifest(Input("b", "boolean", "B.")))


@pytest.mark.parametrize(("given", "coerced"), [
    ("5", 5), ("5.5", 5.5), (" 12 ", 12), ("\t7\n", 7), (" ", 0), ("0x10", 16), ("0o17", 15), ("0b101", 5),
    ("1e3", 1000), (".5", 0.5), ("5.", 5), ("-3", -3), ("+4", 4), ("5.0", 5),
    (True, 1), (False, 0), (None, 0), (5, 5), (2.5, 2.5),
])
def test_coercion_to_number(given: Any, coerced: Any) -> None:
    result = validate_arguments(NUMBER, {"n": given})["n"]
    assert result == coerced and type(result) is type(coerced)


@pytest.mark.parametrize("given", ["", "abc", "12px", "-0x10", "1_000", "Infinity", "NaN", "1e999", "١",
                                   [5], {"a": 1}, math.inf, math.nan])
def test_values_that_do_not_coerce_to_number(given: Any) -> None:
    with pytest.raises(InvalidParams, match='"n" must be a number'):
        validate_arguments(NUMBER, {"n": given})


@pytest.mark.parametrize(("given", "coerced"), [
    ("x", "x"), (5, "5"), (5.0, "5"), (-0.0, "0"), (1.5, "1.5"), (1e21, "1e+21"), (1e20, "100000000000000000000"),
    (1e-7, "1e-7"), (0.000001, "0.000001"), (1.5e300, "1.5e+300"), (123456789012345680000, "123456789012345680000"),
    (True, "true"), (False, "false"), (None, ""),
])
def test_coercion_to_string(given: Any, coerced: str) -> None:
    assert validate_arguments(STRING, {"s": given}) == {"s": coerced}


@pytest.mark.parametrize("given", [[1], {}, [], math.inf])
def test_values_that_do_not_coerce_to_string(given: Any) -> None:
    with pytest.raises(InvalidParams, match='"s" must be a string'):
        validate_arguments(STRING, {"s": given})


@pytest.mark.parametrize(("given", "coerced"), [
    (True, True), (False, False), ("true", True), ("false", False), (1, True), (0, False), (1.0, True), (None, False),
])
def test_coercion_to_boolean(given: Any, coerced: bool) -> None:
    assert validate_arguments(BOOLEAN, {"b": given}) == {"b": coerced}


@pytest.mark.parametrize("given", ["1", "0", "True", "yes", "", 2, -1, [True]])
def test_values_that_do_not_coerce_to_boolean(given: Any) -> None:
    with pytest.raises(InvalidParams, match='"b" must be true or false'):
        validate_arguments(BOOLEAN, {"b": given})


@pytest.mark.parametrize(("number", "text"), [
    (0, "0"), (-7, "-7"), (2**53, "9007199254740992"), (2**60, "1152921504606847000"), (0.1, "0.1"),
    (-1e-7, "-1e-7"), (123e-20, "1.23e-18"), (1e21, "1e+21"), (12345.678, "12345.678"),
])
def test_js_number_to_string(number: float, text: str) -> None:
    assert js_number_to_string(number) == text


def test_enum_values_are_coerced_to_strings_then_checked() -> None:
    schema = input_schema(manifest(Input("level", "enum", "L.", values=("1", "2"))))
    assert validate_arguments(schema, {"level": 1}) == {"level": "1"}
    with pytest.raises(InvalidParams, match=r'"level" must be one of "1", "2", got "3"'):
        validate_arguments(schema, {"level": 3})
    with pytest.raises(InvalidParams, match=r'got ""'):
        validate_arguments(schema, {"level": None})


# --- defaults, copies, violations --------------------------------------------------------------


def test_missing_arguments_with_a_default_get_it() -> None:
    schema = input_schema(manifest(
        Input("limit", "number", "L.", optional=True, default=10),
        Input("format", "string", "F.", default="json"),  # a default satisfies required, as with AJV useDefaults
        Input("verbose", "boolean", "V.", optional=True),
    ))
    assert validate_arguments(schema, {}) == {"limit": 10, "format": "json"}
    assert validate_arguments(schema, {"limit": "3"}) == {"limit": 3, "format": "json"}


def test_the_result_is_a_copy() -> None:
    arguments = {"n": "5"}
    result = validate_arguments(NUMBER, arguments)
    assert arguments == {"n": "5"} and result == {"n": 5} and result is not arguments


def test_every_violation_is_reported_in_one_message() -> None:
    schema = input_schema(manifest(
        Input("name", "string", "Who to greet."),
        Input("count", "number", "How often.", optional=True),
        Input("mode", "enum", "Mode.", values=("single", "batch")),
    ))
    with pytest.raises(InvalidParams) as caught:
        validate_arguments(schema, {"count": "abc", "mode": "many", "colour": "red"}, tool="hello")
    assert caught.value.message == (
        'invalid arguments for tool "hello": "name" is required (string: Who to greet.); '
        '"count" must be a number, got "abc"; "mode" must be one of "single", "batch", got "many"; '
        '"colour" is not an input of this tool (inputs: name, count, mode)'
    )
    assert caught.value.data == [
        {"argument": "name", "message": '"name" is required (string: Who to greet.)'},
        {"argument": "count", "message": '"count" must be a number, got "abc"'},
        {"argument": "mode", "message": '"mode" must be one of "single", "batch", got "many"'},
        {"argument": "colour", "message": '"colour" is not an input of this tool (inputs: name, count, mode)'},
    ]
    assert caught.value.code == -32602


def test_a_required_enum_names_its_choices() -> None:
    schema = input_schema(manifest(Input("mode", "enum", "Mode.", values=("a", "b"))))
    with pytest.raises(InvalidParams, match=r'"mode" is required \(one of "a", "b": Mode.\)'):
        validate_arguments(schema, {})


def test_a_tool_without_inputs_refuses_any_argument() -> None:
    with pytest.raises(InvalidParams, match="inputs: none: it takes no arguments"):
        validate_arguments(input_schema(manifest()), {"x": 1})
    assert validate_arguments(input_schema(manifest()), {}) == {}


@pytest.mark.parametrize(("arguments", "kind"), [(None, "null"), ([], "array"), ("x", "string"), (3, "number")])
def test_arguments_must_be_an_object(arguments: Any, kind: str) -> None:
    with pytest.raises(InvalidParams) as caught:
        validate_arguments(NUMBER, arguments, tool="demo")
    assert caught.value.message == f'invalid arguments for tool "demo": arguments must be an object, got {kind}'


def test_without_a_tool_name_the_message_still_reads() -> None:
    with pytest.raises(InvalidParams, match=r'^invalid arguments: "n" is required'):
        validate_arguments(NUMBER, {})


def test_sensitive_values_never_appear_in_messages() -> None:
    schema = input_schema(manifest(
        Input("token", "number", "T.", sensitive=True),
        Input("region", "enum", "R.", values=("eu", "us"), sensitive=True),
    ))
    with pytest.raises(InvalidParams) as caught:
        validate_arguments(schema, {"token": "hunter2-secret", "region": "hunter3-secret"})
    text = caught.value.message + repr(caught.value.data)
    assert "hunter" not in text
    assert '"token" must be a number, got a string' in text and '"region" must be one of "eu", "us", got another value' in text


def test_long_values_are_shortened_in_messages() -> None:
    with pytest.raises(InvalidParams) as caught:
        validate_arguments(NUMBER, {"n": "x" * 500})
    assert len(caught.value.message) < 150 and caught.value.message.endswith("…")


def test_a_schema_that_allows_extra_properties_passes_them_through() -> None:
    schema = {"type": "object", "properties": {"n": {"type": "number"}}, "required": []}
    assert validate_arguments(schema, {"n": "1", "extra": [1]}) == {"n": 1, "extra": [1]}
