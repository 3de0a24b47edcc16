// Compiled (never run) by tests/test_npm_package.py with `tsc --strict --noEmit` in a
// project that installed @tokend/client from its tarball: the types come through the
// package's `exports` ("types"), as a TypeScript user of `npm install` gets them.
import {
  CloseCode,
  connect,
  type Lifecycle,
  Revoked,
  type Session,
  type SessionOptions,
  TokendError,
} from '@tokend/client';

export async function hold(url: string, token: string): Promise<number> {
  const renewals: Lifecycle[] = [];
  const options: SessionOptions = {
    backoff: { base: 500, cap: 30_000, maxAttempts: null, goingAwayWindow: 5_000 },
    on: { renewed: (change) => renewals.push(change) },
  };
  const session: Session = await connect(url, token, options);
  try {
    await session.wait();
  } catch (error) {
    if (error instanceof Revoked && error.code === CloseCode.TOKEN_REVOKED) return -1;
    if (error instanceof TokendError) return error.code ?? 0;
  }
  const exp: number = session.exp;
  const rtt: number | null = session.stats.lastRtt;
  return exp + renewals.length + (rtt ?? 0);
}
