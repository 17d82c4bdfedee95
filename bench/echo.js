'use strict';
// The floor: a plain JSON-lines echo in Node, no shim, no tool loading. Each
// request {"id":N,"method":"call"} gets the reply the hello tool would give;
// {"id":N,"method":"flood","params":{"count":K}} writes K progress lines first.
// Lines are split on "\n" and written synchronously, as the shim does.
const fs = require('node:fs');

let pending = '';
function reply(line) {
  const msg = JSON.parse(line);
  let out = '';
  if (msg.method === 'flood') {
    const count = msg.params.count;
    for (let i = 1; i <= count; i += 1) {
      fs.writeSync(1, `{"jsonrpc":"2.0","method":"progress","params":{"id":${msg.id},"content":[{"type":"text","text":"step ${i}"}]}}\n`);
    }
  }
  out = JSON.stringify({ jsonrpc: '2.0', id: msg.id, result: { status: 'ok', content: [{ type: 'text', text: 'Hello, World!' }], isError: false } });
  fs.writeSync(1, `${out}\n`);
}
process.stdin.on('data', (chunk) => {
  pending += chunk.toString('utf8');
  let nl;
  while ((nl = pending.indexOf('\n')) !== -1) {
    const line = pending.slice(0, nl);
    pending = pending.slice(nl + 1);
    if (line.trim()) reply(line);
  }
});
process.stdin.on('end', () => process.exit(0));
