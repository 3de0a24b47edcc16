// Compiled (never run) by tests/test_browser.py with `tsc --strict --noEmit`: the
// SDK's declarations (sdk/js/tokend.d.ts) must type the usage of sdk/js/README.md.
import {
  Backoff,
  CloseCode,
  connect,
  LIFECYCLE,
  type Lifecycle,
  RECONNECTABLE,
  Revoked,
  Session,
  TokendError,
} from '../../sdk/js/tokend.js';

export async function run(url: string, token: string): Promise<string> {
  const seen: Lifecycle[] = [];
  const session: Session = await connect(url, token, {
    backoff: { base: 500, cap: 30_000, maxAttempts: null, goingAwayWindow: 5_000 },
    openTimeout: 10_000,
    storage: sessionStorage,
    on: {
      renewed: (change) => seen.push(change),
      reconnecting: ({ code, delay }) => console.log(code ?? 'lost', delay),
      ended: ({ code, meaning, error }) => console.log(code, meaning, error?.reason),
    },
  });
  const off: () => void = session.on('warned', (change) => seen.push(change));
  off();
  const exp: number = session.exp;
  const state: 'ACTIVE' | 'WARN' = session.state;
  const rtt: number | null = session.stats.lastRtt;
  session.pauseHeartbeats();
  session.resumeHeartbeats();
  await session.close();
  try {
    const ca = '-----BEGIN CERTIFICATE-----\n...';
    await new Session(url, token, { backoff: new Backoff({ base: 100 }), ca: [ca] }).start();
  } catch (error) {
    if (error instanceof Revoked && error.code === CloseCode.TOKEN_REVOKED) return error.meaning;
    if (error instanceof TokendError) return `${error.code} ${error.meaning}`;
  }
  const inUse: number = CloseCode.SESSION_IN_USE;
  return `${exp} ${state} ${rtt} ${RECONNECTABLE.has(inUse)} ${LIFECYCLE.length} ${seen.length}`;
}
