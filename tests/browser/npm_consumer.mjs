// The npm package (@tokend/client, installed from the tarball `npm pack` made) under
// Node, for tests/test_npm_package.py: imported by its name, as sdk/js/README.md shows.
//
// argv[2] is "ws" (Node 20: the npm package ws becomes the global WebSocket) or "bare"
// (Node 22 and later: Node's own WebSocket); argv[3] the URL, argv[4] the token. It opens
// a session, waits for its first WELCOME, logs out, and writes one JSON line: what the
// session saw.

if (process.argv[2] === 'ws') {
  const { WebSocket } = await import('ws');
  globalThis.WebSocket ??= WebSocket;
}
const { connect, LIFECYCLE } = await import('@tokend/client');

const [url, token] = process.argv.slice(3);
const seen = [];
const on = Object.fromEntries(LIFECYCLE.map((kind) => [kind, (change) => seen.push(change)]));
const session = await connect(url, token, { backoff: { maxAttempts: 0 }, on });
const connected = session.connected;
await session.close();
const changes = seen.map(({ kind, code, detail }) => ({ kind, code, detail }));
const error = session.error && session.error.message;
process.stdout.write(`${JSON.stringify({ tid: session.tid, connected, changes, error })}\n`);
