// Headless Chromium driven line by line from a Python test (tests/browser/harness.py).
//
// Environment: PLAYWRIGHT_DIR (holds node_modules/playwright-core), CHROMIUM (the
// executable), USER_DATA_DIR (a fresh profile).
// stdin: one JSON command a line, {"id": n, "op": "goto" | "eval" | "screenshot", ...};
// stdout: one JSON object a line: {"id": n, "value": ...} or {"id": n, "error": "..."}
// answering a command, {"report": ...} for each window.reportToTest(...) of the page,
// {"console": "..."} and {"pageerror": "..."} for what the page logs. Commands run
// concurrently (an eval may wait for a long promise); end of stdin closes the browser.

import { createRequire } from 'node:module';
import { createInterface } from 'node:readline';

const { PLAYWRIGHT_DIR, CHROMIUM, USER_DATA_DIR } = process.env;
const { chromium } = createRequire(`${PLAYWRIGHT_DIR}/`)('playwright-core');

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

const context = await chromium.launchPersistentContext(USER_DATA_DIR, {
  executablePath: CHROMIUM,
  headless: true,
  args: FLAGS,
  viewport: { width: 1280, height: 900 },
});
const page = context.pages()[0] ?? (await context.newPage());
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
for await (const line of createInterface({ input: process.stdin })) {
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
