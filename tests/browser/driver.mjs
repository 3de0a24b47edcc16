// Headless Chromium driven line by line from Python tests (tests/browser/harness.py).
//
// One process for a whole test session: it launches Chromium (environment: NODE_DIR
// holding node_modules/playwright-core, CHROMIUM the executable), listens on the Unix
// socket SOCKET, prints {"ready": true}, and runs until its stdin ends.
//
// Each connection to the socket gets one page in a fresh browser context, closed
// with the connection. It reads one JSON command a line, {"id": n, "op": "goto" |
// "eval" | "screenshot", ...}, and writes one JSON object a line: {"ready": true}
// once the page is open, {"id": n, "value": ...} or {"id": n, "error": "..."}
// answering a command, {"report": ...} for each window.reportToTest(...) of the
// page, {"console": "..."} and {"pageerror": "..."} for what the page logs.
// Commands run concurrently (an eval may wait for a long promise).

import { createServer } from 'node:net';
import { createRequire } from 'node:module';
import { createInterface } from 'node:readline';

const { NODE_DIR, CHROMIUM, SOCKET } = process.env;
const { chromium } = createRequire(`${NODE_DIR}/`)('playwright-core');

// Playwright gives the browser a fresh temporary --user-data-dir of its own.
const FLAGS = [
  '--headless',
  '--no-sandbox',
  '--disable-gpu',
  '--disable-background-networking',
  '--disable-quic',
  '--no-first-run',
  '--disable-component-update',
  '--disable-sync',
];

const browser = await chromium.launch({ executablePath: CHROMIUM, headless: true, args: FLAGS });

async function run(page, { op, url, expression, path }) {
  if (op === 'goto') return void (await page.goto(url));
  if (op === 'eval') return page.evaluate(expression);
  if (op === 'screenshot') return void (await page.screenshot({ path, fullPage: true }));
  throw new Error(`unknown op ${op}`);
}

async function servePage(socket) {
  const send = (message) => socket.writable && socket.write(`${JSON.stringify(message)}\n`);
  const context = await browser.newContext({ viewport: { width: 1280, height: 900 } });
  try {
    const page = await context.newPage();
    await page.exposeFunction('reportToTest', (value) => send({ report: value }));
    page.on('console', (message) => send({ console: `${message.type()}: ${message.text()}` }));
    page.on('pageerror', (error) => send({ pageerror: String(error) }));
    send({ ready: true });
    for await (const line of createInterface({ input: socket })) {
      const command = JSON.parse(line);
      run(page, command).then(
        (value) => send({ id: command.id, value: value ?? null }),
        (error) => send({ id: command.id, error: String(error?.message ?? error) }),
      );
    }
    // The test is over: its evaluations still waiting end with the context.
  } finally {
    await context.close();
    socket.end();
  }
}

const server = createServer({ allowHalfOpen: true }, (socket) => {
  socket.on('error', () => {}); // the test went away: its context closes all the same
  servePage(socket).catch((error) => {
    process.stderr.write(`driver: ${error?.stack ?? error}\n`);
    socket.destroy();
  });
});
await new Promise((resolve) => server.listen(SOCKET, resolve));
process.stdout.write(`${JSON.stringify({ ready: true })}\n`);
for await (const line of createInterface({ input: process.stdin })) void line; // until stdin ends
server.close();
await browser.close();
process.exit(0);
