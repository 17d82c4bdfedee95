// A real `sandboxd serve` for the clients' tests, started the way tests/e2e/conftest.py
// starts one: the repo's .venv python, its own data path and socket under a temp dir,
// the seed tools plus clients/testing/tools, sandboxes on network none.

import { execFileSync, spawn } from "node:child_process";
import { cpSync, existsSync, mkdtempSync, openSync, readFileSync, rmSync, writeFileSync } from "node:fs";
import net from "node:net";
import { tmpdir } from "node:os";
import { dirname, join, resolve } from "node:path";
import { fileURLToPath } from "node:url";

const HERE = dirname(fileURLToPath(import.meta.url));
export const REPO = resolve(HERE, "..", "..");
export const TOOLS = join(HERE, "tools");
export const USER = "alice@example.com";

function pingOnce(socketPath) {
  return new Promise((resolvePing) => {
    const socket = net.createConnection({ path: socketPath });
    let buffer = "";
    const done = (ok) => {
      socket.destroy();
      resolvePing(ok);
    };
    socket.setTimeout(2000, () => done(false));
    socket.on("error", () => done(false));
    socket.on("connect", () => socket.write('{"jsonrpc":"2.0","id":1,"method":"ping"}\n'));
    socket.on("data", (data) => {
      buffer += data;
      if (buffer.includes("\n")) done(buffer.includes('"result"'));
    });
  });
}

// CLIENTS_VIA_ROUTER=1: each Daemon is a router in front of two hosts (tests/cluster/fleet.py), USER's home
// the first; `socket` is the router's, so every client under test speaks to the router (docs/scale.md).
const ROUTER = process.env.CLIENTS_VIA_ROUTER === "1";

export class Daemon {
  constructor({ config = "" } = {}) {
    this.tmp = mkdtempSync(join(tmpdir(), "sbd-node-"));
    this.data = join(this.tmp, "data");
    this.socket = join(this.tmp, "sandboxd.sock");
    this.logPath = join(this.tmp, "daemon.log");
    this.configPath = join(this.tmp, "config.yaml");
    writeFileSync(this.configPath, config);
    cpSync(TOOLS, join(this.data, "tools"), { recursive: true });
    this.proc = null;
  }

  async start(timeoutMs = 30_000) {
    const python = join(REPO, ".venv", "bin", "python");
    if (!existsSync(python)) throw new Error(`${python} is missing; run \`make setup\` first`);
    if (ROUTER) return this.startFleet(python, timeoutMs * 3);
    const log = openSync(this.logPath, "a");
    this.proc = spawn(
      python,
      ["-m", "sandboxd", "serve", "--config", this.configPath, "--data-path", this.data,
        "--socket", this.socket, "--seed-tools", join(REPO, "seed", "tools")],
      // PYTHONFAULTHANDLER: a daemon that will not stop is sent SIGABRT first, which writes every thread's stack to its log.
      { cwd: REPO, stdio: ["ignore", log, log], env: { ...process.env, SANDBOXD_SANDBOX_NETWORK: "none", PYTHONFAULTHANDLER: "1" } },
    );
    const exited = new Promise((resolveExit) => this.proc.once("exit", (code, signal) => resolveExit(code ?? signal)));
    this.exited = exited;
    const deadline = Date.now() + timeoutMs;
    while (Date.now() < deadline) {
      if (this.proc.exitCode !== null) throw new Error(`daemon exited with ${this.proc.exitCode}:\n${this.log()}`);
      if (await pingOnce(this.socket)) return this;
      await new Promise((r) => setTimeout(r, 100));
    }
    throw new Error(`daemon did not listen within ${timeoutMs} ms:\n${this.log()}`);
  }

  async startFleet(python, timeoutMs) {
    if (this.fleet !== undefined) return this.restartRouter(timeoutMs); // after kill(): the router comes back
    const log = openSync(this.logPath, "a");
    this.proc = spawn(python, ["-m", "tests.cluster.fleet", "--config", this.configPath, "--tools", TOOLS, "--user", USER],
      { cwd: REPO, stdio: ["ignore", "pipe", log] });
    this.exited = new Promise((resolveExit) => this.proc.once("exit", (code, signal) => resolveExit(code ?? signal)));
    this.fleetLines = [];
    let out = "";
    this.proc.stdout.on("data", (chunk) => {
      out += chunk;
      const lines = out.split("\n");
      out = lines.pop();
      this.fleetLines.push(...lines.map((line) => JSON.parse(line)));
    });
    const exited = this.exited.then(() => { throw new Error(`the fleet exited:\n${this.log()}`); });
    this.fleet = await Promise.race([waitFor(() => this.fleetLines[0], "the fleet's start", timeoutMs), exited]);
    this.socket = this.fleet.socket;
    this.data = this.fleet.hosts.a.data;
    this.configPath = this.fleet.hosts.a.config;
    return this;
  }

  /** SIGHUP: the fleet stops the router (or finds it killed), starts it again, and says so in a line. */
  async restartRouter(timeoutMs = 60_000) {
    const seen = this.fleetLines.length;
    this.proc.kill("SIGHUP");
    await waitFor(() => this.fleetLines.length > seen, "the router's restart", timeoutMs);
    return this;
  }

  async stop(timeoutMs = 40_000) {
    const proc = this.proc;
    if (proc === null || proc.exitCode !== null || proc.signalCode !== null) return;
    proc.kill("SIGTERM");
    const timers = [setTimeout(() => proc.kill("SIGABRT"), timeoutMs), setTimeout(() => proc.kill("SIGKILL"), timeoutMs + 5000)];
    const code = await this.exited;
    timers.forEach(clearTimeout);
    if (code !== 0) throw new Error(`daemon stopped with ${code}:\n${this.log()}`);
  }

  /** Die the way a crash does: no answers, no cleanup (the next start removes the orphans). */
  async kill() {
    if (ROUTER) {
      this.proc.kill("SIGUSR1"); // the fleet SIGKILLs its router
      return waitFor(async () => !(await pingOnce(this.socket)), "the router gone", 20_000);
    }
    this.proc.kill("SIGKILL");
    await this.exited;
  }

  /** Stop, then start again on the same socket and data path. */
  async restart() {
    if (ROUTER) return this.restartRouter();
    await this.stop();
    await this.start();
  }

  userDir(user = USER) {
    return join(this.data, user);
  }

  log() {
    try {
      const router = this.fleet ? `\n-- router --\n${readFileSync(this.fleet.router_log, "utf8").slice(-4000)}` : "";
      return readFileSync(this.logPath, "utf8").slice(-8000) + router;
    } catch {
      return "(no log)";
    }
  }

  /** This daemon's containers, by the instance label the daemon gives them (as tests/e2e do). */
  containers() {
    if (ROUTER) {
      return Object.values(this.fleet?.hosts ?? {}).flatMap((host) => execFileSync("docker",
        ["ps", "-aq", "--filter", `label=org.sandboxd.instance=${host.instance}`], { encoding: "utf8" }).split("\n").filter(Boolean));
    }
    const python = join(REPO, ".venv", "bin", "python");
    const instance = execFileSync(python, ["-c",
      "import sys; from sandboxd.config import load_config; from sandboxd.server.server import instance_id; "
      + "print(instance_id(load_config(overrides={'socket': sys.argv[1], 'data_path': sys.argv[2]}, environ={})))",
      this.socket, this.data], { cwd: REPO, encoding: "utf8" }).trim();
    const out = execFileSync("docker", ["ps", "-aq", "--filter", `label=org.sandboxd.instance=${instance}`], { encoding: "utf8" });
    return out.split("\n").filter(Boolean);
  }

  /** Stop, remove what the daemon left behind, and fail if it left anything. */
  async dispose() {
    await this.stop();
    const leftovers = this.containers();
    if (leftovers.length > 0) execFileSync("docker", ["rm", "-f", ...leftovers]);
    const log = this.log();
    rmSync(this.tmp, { recursive: true, force: true });
    if (leftovers.length > 0) throw new Error(`the daemon left ${leftovers.length} containers behind:\n${log}`);
  }
}

export async function startDaemon(options) {
  const daemon = new Daemon(options);
  try {
    return await daemon.start();
  } catch (error) {
    await daemon.dispose().catch(() => {});
    throw error;
  }
}

/** Poll `check` until it returns a truthy value (evidence, not a sleep); fail after timeoutMs. */
export async function waitFor(check, what, timeoutMs = 20_000) {
  const deadline = Date.now() + timeoutMs;
  for (;;) {
    const value = await check();
    if (value) return value;
    if (Date.now() > deadline) throw new Error(`timed out after ${timeoutMs} ms waiting for ${what}`);
    await new Promise((r) => setTimeout(r, 50));
  }
}
