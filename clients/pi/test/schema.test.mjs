// The pure parts of the extension: inputSchema → TypeBox, and which env is passed on.

import assert from "node:assert/strict";
import { test } from "node:test";

import { validateToolArguments } from "@mariozechner/pi-ai";

import { DEFAULT_ENV_NAMES, integrationEnv, toolParameters } from "../dist/index.js";

// As it comes off the wire (JSON.parse): "__proto__" is an own key, as TOOL.md allows that input name.
const SCHEMA = `{"type": "object", "additionalProperties": false, "required": ["query", "__proto__"], "properties": {
  "query": {"type": "string", "description": "What to look for."},
  "max": {"type": "number", "default": 10},
  "exact": {"type": "boolean"},
  "mode": {"type": "string", "enum": ["single", "batch"], "default": "single"},
  "token": {"type": "string", "writeOnly": true},
  "__proto__": {"type": "string"}}}`;

test("inputSchema becomes a TypeBox object pi validates with: types, enum, optional, default, writeOnly", () => {
  const parameters = toolParameters(JSON.parse(SCHEMA));
  assert.equal(parameters.type, "object");
  assert.equal(parameters.additionalProperties, false);
  assert.deepEqual(parameters.required, ["query", "__proto__"]);
  assert.deepEqual(Object.keys(parameters.properties), ["query", "max", "exact", "mode", "token", "__proto__"]);
  assert.equal(Object.getPrototypeOf(parameters.properties), Object.prototype);
  assert.equal(parameters.properties.query.description, "What to look for.");
  assert.equal(parameters.properties.max.default, 10);
  assert.equal(parameters.properties.exact.type, "boolean");
  assert.deepEqual(parameters.properties.mode.enum, ["single", "batch"]);
  assert.equal(parameters.properties.token.writeOnly, true);
  const tool = { name: "t", description: "", parameters };
  const call = (args) => validateToolArguments(tool, { type: "toolCall", id: "1", name: "t", arguments: args });
  const args = (text) => JSON.parse(text);
  assert.deepEqual(call(args('{"query": "x", "__proto__": "y", "max": "5"}')), args('{"query": "x", "__proto__": "y", "max": 5}'));
  assert.throws(() => call(args('{"__proto__": "y"}')), /query/);
  assert.throws(() => call(args('{"query": "x", "__proto__": "y", "mode": "all"}')), /mode/);
  assert.throws(() => call(args('{"query": "x", "__proto__": "y", "extra": 1}')), /Validation failed/);
});

test("only allowed names that are set are passed on as env", () => {
  const source = { OFFICER_RESOURCES: "{}", PI_SEARXNG_URL: "", PATH: "/usr/bin", OFFICER_APIFY_TOKEN: undefined };
  assert.deepEqual(integrationEnv(source, DEFAULT_ENV_NAMES), { OFFICER_RESOURCES: "{}", PI_SEARXNG_URL: "" });
  assert.deepEqual(integrationEnv(source, ["PATH"]), { PATH: "/usr/bin" });
});
