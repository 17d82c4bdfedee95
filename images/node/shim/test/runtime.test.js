'use strict';
// The shim follows the Node that runs it (make test-shim runs this on the image's Node,
// images/node/node-runtime.sh): esbuild's target, and the major line of undici.
const { test } = require('node:test');
const assert = require('node:assert/strict');

const { NODE_TARGET } = require('../src/loader');

const major = (version) => version.replace(/^v/, '').split('.')[0];

test("esbuild transpiles for this Node's major version", () => {
  assert.equal(NODE_TARGET, `node${major(process.version)}`);
});

test("the shim's undici is on the major line of the undici behind this Node's fetch", () => {
  // Both read the global dispatcher the shim sets; their Dispatcher APIs must agree.
  const own = require('undici/package.json').version;
  assert.equal(major(own), major(process.versions.undici), `npm undici ${own}, Node's own ${process.versions.undici}`);
});
