// The shim's own tool, called once before `ready` on no one's behalf (main.js, warmUp), so
// that a sandbox's first real call finds the call path compiled and set up. CommonJS with a
// source map, as esbuild writes a tool: the loader takes it as its own transpiled code.
'use strict';
exports.execute = async (_toolCallId, params) => ({ content: [{ type: 'text', text: `Hello, ${params.name}!` }] });
//# sourceMappingURL=data:application/json;base64,eyJ2ZXJzaW9uIjozLCJzb3VyY2VzIjpbImluZGV4LnRzIl0sIm5hbWVzIjpbXSwibWFwcGluZ3MiOiI7QUFHQSJ9
