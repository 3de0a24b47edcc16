// The browser SDK (sdk/js/tokend.js) under Node, for tests/test_browser.py.
//
// Node 22 has a global WebSocket; on older Node the npm package `ws` stands in for it
// (environment: NODE_DIR holding node_modules/ws). argv[2] is a JSON object
// {url, token, options, holdMs, floodMs}: a session is opened with `options` (lifecycle
// callbacks added), held for `holdMs`, until it ends or until stdin ends, then logged
// out. With `floodMs`, it also sends a heartbeat every `floodMs` (resumeHeartbeats): a
// client faster than the cadence. Every line written is JSON, as it happens: {"change": ...} per lifecycle
// change, then {"held": {stats, connected}} and {"done": {error}}.

import { createRequire } from 'node:module';

const { NODE_DIR } = process.env;
globalThis.WebSocket ??= createRequire(`${NODE_DIR}/`)('ws').WebSocket;
const tokend = await import('../../sdk/js/tokend.js');

const { url, token, options = {}, holdMs, floodMs = 0 } = JSON.parse(process.argv[2]);
const say = (message) => process.stdout.write(`${JSON.stringify(message)}\n`);
const report = ({ error, token: _token, ...change }) =>
  say({ change: { ...change, error: error && { name: error.name, reason: error.reason } } });
const on = Object.fromEntries(tokend.LIFECYCLE.map((kind) => [kind, report]));
const session = new tokend.Session(url, token, { ...options, on });
session.open();
const flood = floodMs ? setInterval(() => session.resumeHeartbeats(), floodMs) : null;

const ended = session.wait().then(
  () => null,
  (error) => error,
);
const released = new Promise((resolve) => process.stdin.on('close', resolve).resume());
let timer;
const held = new Promise((resolve) => (timer = setTimeout(resolve, holdMs)));
await Promise.race([ended, held, released]);
clearTimeout(timer);
clearInterval(flood);
say({ held: { stats: session.stats, connected: session.connected } });
await session.close();
const error = await ended;
say({ done: { error: error && { name: error.name, code: error.code, reason: error.reason } } });
process.stdin.destroy();
