'use strict';
// The browser relay (docs/shim.md, "The browser relay"). Tools reach it at
// 127.0.0.1:$OFFICER_BROWSER_RELAY_PORT, which in a sandbox is the sandbox's own loopback.
// For a call whose port the operator's integrations.browser_relay covers, the daemon
// says so in the call (browserRelay: {port}); this module then listens on 127.0.0.1 and
// ::1 at that port for the call, and sends each connection through the egress socket as
// CONNECT browser-relay.sandboxd.invalid:PORT, which the daemon connects to the relay and
// nowhere else. fetch and http(s) to that port take the same way (egress.js asks
// tunnelHost). A port the daemon refused (browserRelay: {port, error}) gets no listener:
// a tool's connection is refused at once, and its error says why (hint).
// Nothing here is a defence: the daemon decides, for the call it runs.
const dns = require('node:dns');
const net = require('node:net');
const { pipeline } = require('node:stream');

// listen({host}) looks the address up with dns.lookup, which a tool may have replaced (the
// egress test fixture fails every lookup): the relay listens with Node's own.
const nodeLookup = dns.lookup;

const RELAY_NAME = 'browser-relay.sandboxd.invalid';
const LOOPBACK_HOSTS = new Set(['127.0.0.1', 'localhost', '::1', '[::1]']);
const LISTEN_HOSTS = ['127.0.0.1', '::1'];

/** @type {null | {port: number|null, error: string|null, servers: net.Server[]}} */
let current = null;

/** A tool's connection: through the egress socket to the relay, both ways, once the daemon agrees. */
function forward(client, port, openTunnel, log) {
  client.on('error', () => {});
  openTunnel(RELAY_NAME, port).then(
    (tunnel) => pipeline(client, tunnel, client, () => {}),
    (e) => {
      log(`browser relay: ${e.message}`);
      client.destroy();
    },
  );
}

function listen(call, host, openTunnel, log) {
  return new Promise((resolve) => {
    const server = net.createServer({ pauseOnConnect: true, allowHalfOpen: true }, (client) =>
      forward(client, call.port, openTunnel, log));
    server.unref();
    server.once('error', (e) => {
      // ::1 is missing where the sandbox has no IPv6; a port a tool took first is the tool's doing.
      if (host !== '::1' || e.code !== 'EADDRNOTAVAIL') {
        log(`browser relay: cannot listen on ${host}:${call.port} (${e.code || e.message}); tools do not reach it`);
      }
      resolve();
    });
    const toolLookup = dns.lookup;
    dns.lookup = nodeLookup; // net calls it within listen(), synchronously
    try {
      server.listen({ host, port: call.port, exclusive: true }, () => {
        call.servers.push(server);
        resolve();
      });
    } finally {
      dns.lookup = toolLookup;
    }
  });
}

/**
 * A call starts with the daemon's `browserRelay`: listen on its port (resolves once
 * listening), or remember why not. `openTunnel` is egress.js's.
 */
function forCall(info, openTunnel, log) {
  endCall();
  if (!info || typeof info !== 'object') return Promise.resolve();
  const port = Number.isInteger(info.port) ? info.port : null;
  const call = { port, error: typeof info.error === 'string' ? info.error : null, servers: [] };
  current = call;
  if (call.error !== null || port === null) return Promise.resolve();
  return Promise.all(LISTEN_HOSTS.map((host) => listen(call, host, openTunnel, log))).then(() => undefined);
}

/** The call is over: no new connections (those made stay open, as other egress tunnels do). */
function endCall() {
  if (current === null) return;
  for (const server of current.servers) server.close();
  current = null;
}

/** The name to CONNECT to for host:port: the relay's for the call's port on loopback, else null. */
function tunnelHost(host, port) {
  if (current === null || current.port === null || Number(port) !== current.port) return null;
  return LOOPBACK_HOSTS.has(String(host).toLowerCase()) ? RELAY_NAME : null;
}

/** Why a connection to the call's relay port was refused, for its error message; else null. */
function hint(err) {
  if (current === null || current.error === null || err.code !== 'ECONNREFUSED' || err.port !== current.port) return null;
  return current.error;
}

module.exports = { forCall, endCall, tunnelHost, hint, RELAY_NAME };
