// Headless Chromium driven line by line from a Python test (tests/browser/harness.py).
//
// `node driver.mjs serve`: launch Chromium once (environment: NODE_DIR holding
// node_modules/playwright-core, CHROMIUM the executable) behind a Playwright server on
// loopback; print {"endpoint": "ws://..."}; close it when stdin ends.
//
// `node driver.mjs page`: connect to that server (ENDPOINT) and open one page in a
// fresh browser context. stdin: one JSON command a line, {"id": n, "op": "goto" |
// "eval" | "screenshot", ...}; stdout: one JSON object a line: {"id": n, "value": ...}
// or {"id": n, "error": "..."} answering a command, {"report": ...} for each
// window.reportToTest(...) of the page, {"console": "..."} and {"pageerror": "..."}
// for what the page logs. Commands run concurrently (an eval may wait for a long
// promise); the end of stdin closes the context.

import { createRequire } from 'node:module';
import { createInterface } from 'node:readline';

const { NODE_DIR, CHROMIUM, ENDPOINT } = process.env;
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

const emit = (message) => process.stdout.write(`${JSON.stringify(message)}\n`);
const commands = () => createInterface({ input: process.stdin });

if (process.argv[2] === 'serve') {
  const server = await chromium.launchServer({
    executablePath: CHROMIUM,
    headless: true,
    args: FLAGS,
    host: '127.0.0.1',
  });
  emit({ endpoint: server.wsEndpoint() });
  for await (const line of commands()) void line; // until stdin ends
  await server.close();
  process.exit(0);
}

const browser = await chromium.connect(ENDPOINT);
const context = await browser.newContext({ viewport: { width: 1280, height: 900 } });
const page = await context.newPage();
await page.exposeFunction('reportToTest', (value) => emit({ report: value }));
page.on('console', (message) => emit({ console: `${message.type()}: ${message.text()}` }));
page.on('pageerror', (error) => emit({ pageerror: String(error) }));

async function run({ op, url, expression, path }) {
  if (op === 'goto') return void (await page.goto(url));
  if (op === 'eval') return page.evaluate(expression);
  if (op === 'screenshot') return void (await page.screenshot({ path, fullPage: true }));
  throw new Error(`unknown op ${op}`);
}

const pending = new Set();
emit({ ready: true });
for await (const line of commands()) {
  const command = JSON.parse(line);
  const done = run(command).then(
    (value) => emit({ id: command.id, value: value ?? null }),
    (error) => emit({ id: command.id, error: String(error?.message ?? error) }),
  );
  pending.add(done);
  done.finally(() => pending.delete(done));
}
await Promise.allSettled(pending);
await context.close();
await browser.close();
