'use strict';
// A fake egress proxy on a unix socket, for the shim's egress tests: each request head that
// arrives (up to its blank line) goes to `answer(socket, head)`, which replies as the test wants.
const net = require('node:net');

/** @returns {Promise<net.Server>} listening at socketPath */
function listenFakeProxy(socketPath, answer) {
  const server = net.createServer((sock) => {
    let buf = '';
    sock.on('error', () => {});
    sock.on('data', (d) => {
      buf += d.toString('latin1');
      const end = buf.indexOf('\r\n\r\n');
      if (end !== -1) {
        const head = buf.slice(0, end);
        buf = buf.slice(end + 4);
        answer(sock, head);
      }
    });
  });
  return new Promise((resolve) => server.listen(socketPath, () => resolve(server)));
}

module.exports = { listenFakeProxy };
