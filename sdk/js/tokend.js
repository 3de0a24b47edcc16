/**
 * Browser SDK for tokend protocol v1: an ES module, no build step.
 *
 *     import { connect } from './tokend.js';
 *     const session = await connect('wss://example.test/v1/ws', token, {
 *       on: { renewed: (e) => store(e.token), ended: (e) => console.log(e.code, e.meaning) },
 *     });
 *
 * A {@link Session} says HELLO, keeps the heartbeat cadence the server gave in
 * WELCOME (each heartbeat carrying its HMAC-SHA256 proof, computed with WebCrypto,
 * and the next `seq`), takes in renewed tokens (`session.token` and `session.exp`
 * are always the newest), follows WARN notices, and reports every step to its
 * lifecycle callbacks. On the close codes the spec marks reconnectable (1001,
 * 1011, 1013, 4008, 4029, 4509) and on network loss it reconnects with full-jitter
 * exponential backoff and resumes with its newest token, proving with the session
 * key of its last WELCOME that it is the session's rightful client (spec "Resume
 * proof", revision 2; `options.storage` keeps token and key across a page reload).
 * After a 1001 the first reconnect is spread over a window, and under Node with
 * `ws` an HTTP 503 or 429 with Retry-After is honoured. Any other close ends the
 * session with a {@link TokendError} naming the family.
 *
 * It mirrors the Python SDK (sdk/python/tokend_client/core.py) and its frame codec
 * (tokend/core/protocol.py) byte for byte; the wire format is docs/protocol.md
 * (section 2, "Frames"), the behaviour docs/client.md. Usage: sdk/js/README.md.
 *
 * WebCrypto needs a secure context: serve the page over https, or from localhost.
 */

export const VERSION = 1;
export const SUBPROTOCOL = 'tokend.v1';
export const WS_PATH = '/v1/ws';
export const MAX_TOKEN_LENGTH = 8192;

const TID_LENGTH = 16;
const SESSION_KEY_LENGTH = 32;
const MAC_LENGTH = 16;
const SIGNED_LENGTH = 34; // the heartbeat bytes covered by the mac
const HEARTBEAT_LENGTH = SIGNED_LENGTH + MAC_LENGTH; // 50
const WELCOME_LENGTH = 72;
const RESUME_PROOF_LENGTH = 16;
const RESUME_PROOF_LABEL = 'tokend-resume';
const ACK_HEAD_LENGTH = 20;
const NOTICE_LENGTH = 2;

/** Frame types (spec "Frames", byte 0 of every message). */
export const FrameType = Object.freeze({
  HELLO: 0x01,
  WELCOME: 0x02,
  HEARTBEAT: 0x03,
  HEARTBEAT_ACK: 0x04,
  BYE: 0x05,
  NOTICE: 0x06,
});

// HEARTBEAT_ACK flag bits (spec 0x04) and the WELCOME flag bit (spec 0x02).
const ACK_RENEWED = 0x01;
const ACK_RESENT = 0x02;
const ACK_WAS_WARN = 0x04;
const WELCOME_RESUMED = 0x01;
const STATE_ACTIVE = 0;
const STATE_WARN = 1;

/** Close codes of the spec's table "Close codes". */
export const CloseCode = Object.freeze({
  NORMAL: 1000,
  GOING_AWAY: 1001,
  MESSAGE_TOO_BIG: 1009,
  INTERNAL_ERROR: 1011,
  TRY_AGAIN_LATER: 1013,
  HELLO_TIMEOUT: 4008,
  RATE_LIMITED: 4029,
  INVALID_TOKEN: 4501,
  TOKEN_EXPIRED: 4502,
  PROTOCOL_ERROR: 4503,
  BAD_HEARTBEAT: 4504,
  SESSION_EXPIRED: 4505,
  TOKEN_REVOKED: 4506,
  TAKEN_OVER: 4507,
  SESSION_IN_USE: 4509,
});

const CLOSE_REASONS = new Map([
  [1000, 'bye'],
  [1001, 'server going away'],
  [1009, 'message too big'],
  [1011, 'internal error'],
  [1013, 'try again later'],
  [4008, 'no HELLO in time'],
  [4029, 'rate limited'],
  [4501, 'invalid token'],
  [4502, 'token expired'],
  [4503, 'protocol error'],
  [4504, 'bad heartbeat proof'],
  [4505, 'session expired'],
  [4506, 'token revoked'],
  [4507, 'session taken over'],
  [4509, 'session in use by another connection'],
]);

/** The close codes that invite a reconnect (protocol.RECONNECTABLE); the others end the token. */
export const RECONNECTABLE = Object.freeze(new Set([1001, 1011, 1013, 4008, 4029, 4509]));

// What the browser reports for a connection that ended without a close frame.
const ABNORMAL_CLOSURE = 1006;
// Browsers may only send 1000 or 3000-4999: a server that breaks the protocol is
// told so with the protocol's own code.
const CLIENT_VIOLATION_CODE = CloseCode.PROTOCOL_ERROR;

/** The lifecycle kinds, in the order a session can go through them. */
export const LIFECYCLE = Object.freeze([
  'connected',
  'renewed',
  'warned',
  'recovered',
  'reconnecting',
  'resumed',
  'ended',
]);

/**
 * A close code in words; null is a connection lost without a close frame.
 * @param {number | null} code
 * @returns {string}
 */
export function describe(code) {
  if (code === null || code === undefined) return 'connection lost';
  return CLOSE_REASONS.get(code) ?? `close code ${code}`;
}

// Errors

/**
 * Why a session ended for good. `code` is the close code that decided it, or
 * null when no close frame did (a malformed frame, a refused handshake,
 * reconnect attempts used up).
 */
export class TokendError extends Error {
  /**
   * @param {number | null} code
   * @param {string} [reason]
   */
  constructor(code, reason = '') {
    const meaning = code === null ? reason : describe(code);
    const head = code === null ? reason : `${code} ${meaning}`;
    super(code !== null && reason && reason !== meaning ? `${head}: ${reason}` : head);
    this.name = new.target.name;
    /** @type {number | null} */
    this.code = code;
    /** @type {string} */
    this.reason = reason;
  }

  /** The close code in words, e.g. "token revoked"; the reason when there is no code. */
  get meaning() {
    return this.code === null ? this.reason : describe(this.code);
  }
}

/** The token was refused: 4501 invalid token, 4502 token expired at HELLO. Get a new one. */
export class AuthError extends TokendError {}
/** 4505: the session expired (heartbeats missed, or the token's exp passed). */
export class SessionExpired extends TokendError {}
/** 4506: the token was revoked, or its session logged out (BYE) elsewhere. */
export class Revoked extends TokendError {}
/** 4507: a newer connection resumed this session; this one stops. */
export class TakenOver extends Revoked {}
/** 1009, 4503, 4504, or a server that does not speak protocol v1: a bug, not retried. */
export class ProtocolViolation extends TokendError {}
/** `backoff.maxAttempts` reconnect attempts in a row failed; `code` is the last one. */
export class RetriesExhausted extends TokendError {}

const TERMINAL = new Map([
  [4501, AuthError],
  [4502, AuthError],
  [4505, SessionExpired],
  [4506, Revoked],
  [4507, TakenOver],
  [1009, ProtocolViolation],
  [4503, ProtocolViolation],
  [4504, ProtocolViolation],
]);

/**
 * The error class a close ends the session with; null when it invites a reconnect.
 * @param {number | null} code
 * @returns {typeof TokendError | null}
 */
export function classify(code) {
  if (code === null || RECONNECTABLE.has(code)) return null;
  return TERMINAL.get(code) ?? TokendError;
}

/** A server message that is not a well-formed protocol v1 frame. */
export class ProtocolError extends Error {
  name = 'ProtocolError';
}

// Frame codec

/**
 * HELLO (spec 0x01): type, version, u16 token length, the token in ASCII, then the
 * 16-byte resume proof if given (spec "Resume proof", revision 2).
 * @param {string} token
 * @param {Uint8Array | null} [proof] from {@link resumeProof}
 * @returns {Uint8Array}
 */
export function encodeHello(token, proof = null) {
  const length = token.length;
  if (!/^[\x00-\x7f]*$/.test(token)) throw new ProtocolError('hello: the token is not ASCII');
  if (length < 1 || length > MAX_TOKEN_LENGTH) {
    throw new ProtocolError('hello: token length must be 1..8192');
  }
  if (proof !== null && proof.length !== RESUME_PROOF_LENGTH) {
    throw new ProtocolError('hello: a resume proof is 16 bytes');
  }
  const frame = new Uint8Array(4 + length + (proof === null ? 0 : RESUME_PROOF_LENGTH));
  const view = new DataView(frame.buffer);
  view.setUint8(0, FrameType.HELLO);
  view.setUint8(1, VERSION);
  view.setUint16(2, length);
  for (let i = 0; i < length; i += 1) frame[4 + i] = token.charCodeAt(i);
  if (proof !== null) frame.set(proof, 4 + length);
  return frame;
}

/**
 * The resume proof (spec "Resume proof", revision 2): the first 16 bytes of
 * HMAC-SHA256(session key, "tokend-resume" || tid), the session key being that of
 * the last WELCOME received for the session.
 * @param {Uint8Array} sessionKey 32 bytes
 * @param {Uint8Array} tid 16 bytes
 * @returns {Promise<Uint8Array>}
 */
export async function resumeProof(sessionKey, tid) {
  if (sessionKey.length !== SESSION_KEY_LENGTH || tid.length !== TID_LENGTH) {
    throw new ProtocolError('resume proof: the session key is 32 bytes, tid 16 bytes');
  }
  const label = new TextEncoder().encode(RESUME_PROOF_LABEL);
  const message = new Uint8Array(label.length + TID_LENGTH);
  message.set(label);
  message.set(tid, label.length);
  const mac = await crypto.subtle.sign('HMAC', await importSessionKey(sessionKey), message);
  return new Uint8Array(mac, 0, RESUME_PROOF_LENGTH);
}

/** BYE (spec 0x05): one byte. */
export function encodeBye() {
  return Uint8Array.of(FrameType.BYE);
}

/**
 * The key a session's heartbeat proofs are computed with (WELCOME's session key).
 * @param {Uint8Array} sessionKey
 * @returns {Promise<CryptoKey>}
 */
export function importSessionKey(sessionKey) {
  return crypto.subtle.importKey('raw', sessionKey, { name: 'HMAC', hash: 'SHA-256' }, false, [
    'sign',
  ]);
}

/**
 * HEARTBEAT (spec 0x03): type, flags 0, tid, u64 seq, u64 exp ms, then the mac:
 * the first 16 bytes of HMAC-SHA256(session key, the first 34 bytes).
 * @param {CryptoKey} key from {@link importSessionKey}
 * @param {Uint8Array} tid 16 bytes
 * @param {number} seq
 * @param {number} expMs
 * @returns {Promise<Uint8Array>}
 */
export async function encodeHeartbeat(key, tid, seq, expMs) {
  if (tid.length !== TID_LENGTH) throw new ProtocolError('heartbeat: tid is 16 bytes');
  const frame = new Uint8Array(HEARTBEAT_LENGTH);
  const view = new DataView(frame.buffer);
  view.setUint8(0, FrameType.HEARTBEAT);
  view.setUint8(1, 0);
  frame.set(tid, 2);
  view.setBigUint64(18, BigInt(seq));
  view.setBigUint64(26, BigInt(expMs));
  const mac = await crypto.subtle.sign('HMAC', key, frame.subarray(0, SIGNED_LENGTH));
  frame.set(new Uint8Array(mac, 0, MAC_LENGTH), SIGNED_LENGTH);
  return frame;
}

/**
 * @typedef {{type: 'welcome', tid: Uint8Array, expMs: number, heartbeatMs: number,
 *   warnMs: number, expireMs: number, sessionKey: Uint8Array, resumed: boolean}} Welcome
 * @typedef {{type: 'ack', seq: number, expMs: number, token: string | null,
 *   renewed: boolean, resent: boolean, wasWarn: boolean}} HeartbeatAck
 * @typedef {{type: 'notice', state: 'WARN'}} Notice
 */

const CLIENT_FRAME_NAMES = new Map([
  [FrameType.HELLO, 'HELLO'],
  [FrameType.HEARTBEAT, 'HEARTBEAT'],
  [FrameType.BYE, 'BYE'],
]);

/**
 * Parse one binary message from the server. The length must match the type's
 * layout exactly, reserved flag bits must be zero, enumerated fields defined
 * (spec "Frames"); anything else throws {@link ProtocolError}.
 * @param {ArrayBuffer} data
 * @returns {Welcome | HeartbeatAck | Notice}
 */
export function decodeServerFrame(data) {
  const bytes = new Uint8Array(data);
  const view = new DataView(data);
  const size = bytes.length;
  if (size === 0) throw new ProtocolError('empty message');
  const kind = bytes[0];
  if (kind === FrameType.HEARTBEAT_ACK) {
    if (size < ACK_HEAD_LENGTH) throw new ProtocolError('ack shorter than its header');
    const flags = bytes[1];
    const length = view.getUint16(18);
    if (flags & ~(ACK_RENEWED | ACK_RESENT | ACK_WAS_WARN)) {
      throw new ProtocolError('ack has reserved flag bits set');
    }
    if (size !== ACK_HEAD_LENGTH + length || length > MAX_TOKEN_LENGTH) {
      throw new ProtocolError('ack token length does not match the message');
    }
    if (Boolean(flags & (ACK_RENEWED | ACK_RESENT)) !== length > 0) {
      throw new ProtocolError('ack token present without its flag, or flag without token');
    }
    return {
      type: 'ack',
      seq: Number(view.getBigUint64(2)),
      expMs: Number(view.getBigUint64(10)),
      token: length ? ascii(bytes.subarray(ACK_HEAD_LENGTH), 'ack token') : null,
      renewed: Boolean(flags & ACK_RENEWED),
      resent: Boolean(flags & ACK_RESENT),
      wasWarn: Boolean(flags & ACK_WAS_WARN),
    };
  }
  if (kind === FrameType.WELCOME) {
    if (size !== WELCOME_LENGTH) throw new ProtocolError(`welcome is 72 bytes, got ${size}`);
    if (bytes[1] !== VERSION || bytes[2] !== STATE_ACTIVE || bytes[3] & ~WELCOME_RESUMED) {
      throw new ProtocolError('welcome has an unknown version, state or flag');
    }
    return {
      type: 'welcome',
      tid: bytes.slice(4, 20),
      expMs: Number(view.getBigUint64(20)),
      heartbeatMs: view.getUint32(28),
      warnMs: view.getUint32(32),
      expireMs: view.getUint32(36),
      sessionKey: bytes.slice(40, 40 + SESSION_KEY_LENGTH),
      resumed: Boolean(bytes[3] & WELCOME_RESUMED),
    };
  }
  if (kind === FrameType.NOTICE) {
    if (size !== NOTICE_LENGTH) throw new ProtocolError(`notice is 2 bytes, got ${size}`);
    if (bytes[1] !== STATE_WARN) throw new ProtocolError(`notice with unknown state ${bytes[1]}`);
    return { type: 'notice', state: 'WARN' };
  }
  if (CLIENT_FRAME_NAMES.has(kind)) {
    throw new ProtocolError(`client frame ${CLIENT_FRAME_NAMES.get(kind)} from the server`);
  }
  throw new ProtocolError(`unknown frame type 0x${kind.toString(16).padStart(2, '0')}`);
}

function ascii(bytes, what) {
  if (bytes.some((b) => b > 0x7f)) throw new ProtocolError(`${what} is not ASCII`);
  return String.fromCharCode(...bytes);
}

// Tokens

const UUID_PATTERN = /^[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}$/;

/**
 * `{tid, sub, exp}` (exp in ms) read from a token without verifying it (the server does).
 * @param {string} token
 * @returns {{tid: string, sub: string, exp: number}}
 */
export function tokenClaims(token) {
  const parts = typeof token === 'string' ? token.split('.') : [];
  let claims;
  try {
    if (parts.length !== 3) throw new Error('not three segments');
    const b64 = parts[1].replace(/-/g, '+').replace(/_/g, '/');
    const raw = atob(b64 + '='.repeat((4 - (b64.length % 4)) % 4));
    claims = JSON.parse(new TextDecoder().decode(Uint8Array.from(raw, (c) => c.charCodeAt(0))));
  } catch (exc) {
    throw new AuthError(null, `not a JWT: ${exc.message}`);
  }
  if (claims === null || typeof claims !== 'object') throw new AuthError(null, 'not a JWT');
  if (typeof claims.jti !== 'string' || !UUID_PATTERN.test(claims.jti)) {
    throw new AuthError(null, "the token's jti is not a UUID");
  }
  if (!Number.isInteger(claims.exp))
    throw new AuthError(null, 'the token has no integer exp claim');
  return { tid: claims.jti, sub: String(claims.sub ?? ''), exp: claims.exp * 1000 };
}

function tidBytes(tid) {
  const hex = tid.replace(/-/g, '');
  return Uint8Array.from({ length: TID_LENGTH }, (_, i) =>
    parseInt(hex.slice(2 * i, 2 * i + 2), 16),
  );
}

function sameBytes(a, b) {
  return a.length === b.length && a.every((value, i) => value === b[i]);
}

function toHex(bytes) {
  return Array.from(bytes, (b) => b.toString(16).padStart(2, '0')).join('');
}

function fromHex(hex) {
  if (!/^([0-9a-f]{2})*$/.test(hex)) throw new TypeError('not hex');
  return Uint8Array.from(hex.match(/../g) ?? [], (pair) => parseInt(pair, 16));
}

/**
 * The milliseconds of a Retry-After header (RFC 9110 §10.2.3, delay-seconds; tokend
 * sends those); null when absent or not a number of seconds (an HTTP-date).
 * @param {string | undefined} value
 * @returns {number | null}
 */
function retryAfterMs(value) {
  const seconds = value?.trim();
  return seconds && /^[0-9]+$/.test(seconds) ? Number(seconds) * 1000 : null;
}

// Backoff

/**
 * Full-jitter exponential backoff between reconnect attempts, in milliseconds.
 * Attempt `n` (0 for the first retry) waits `uniform(0, min(cap, base * 2**n))`.
 * The count starts again once a connection has had a heartbeat acknowledged.
 * `maxAttempts` bounds failed attempts in a row (null: retry for as long as the
 * failures are reconnectable; a terminal code always stops).
 *
 * Two refusals are waited out longer, so that the clients of a restarting server
 * do not come back all at once: a close 1001 (the server drains, reloads or stops:
 * all its clients at once) waits `uniform(0, goingAwayWindow)`
 * ({@link Backoff#afterGoingAway}); an HTTP 503 or 429 with Retry-After (seen only
 * under Node with `ws`) waits that long and more ({@link Backoff#afterRefusal}).
 */
export class Backoff {
  /**
   * @param {{base?: number, cap?: number, maxAttempts?: number | null,
   *   goingAwayWindow?: number}} [options]
   */
  constructor({ base = 500, cap = 30_000, maxAttempts = null, goingAwayWindow = 5_000 } = {}) {
    if (!(base > 0 && base <= cap)) throw new RangeError('backoff needs 0 < base <= cap');
    if (maxAttempts !== null && !(Number.isInteger(maxAttempts) && maxAttempts >= 0)) {
      throw new RangeError('maxAttempts must be null or an integer >= 0');
    }
    if (!(goingAwayWindow >= 0)) throw new RangeError('goingAwayWindow must be >= 0');
    this.base = base;
    this.cap = cap;
    this.maxAttempts = maxAttempts;
    this.goingAwayWindow = goingAwayWindow;
  }

  /** The longest wait of attempt `attempt`, ms. */
  ceiling(attempt) {
    return Math.min(this.cap, this.base * 2 ** Math.min(attempt, 64));
  }

  /** A random wait for attempt `attempt`, ms. */
  delay(attempt) {
    return Math.random() * this.ceiling(attempt);
  }

  /**
   * The wait after a close 1001, ms: uniform over `goingAwayWindow` (at most `limit`:
   * what the session can spare), or over the attempt's ceiling if longer.
   */
  afterGoingAway(attempt, limit = Infinity) {
    return Math.random() * Math.max(Math.min(this.goingAwayWindow, limit), this.ceiling(attempt));
  }

  /**
   * The wait after an HTTP refusal that said Retry-After (`retryAfter` ms): never
   * sooner, plus a random share of as long again (or of the attempt's ceiling, if
   * longer) so that the clients refused together do not return together.
   */
  afterRefusal(attempt, retryAfter) {
    return retryAfter + Math.random() * Math.max(retryAfter, this.ceiling(attempt));
  }
}

// The session

/**
 * @typedef {'connected' | 'renewed' | 'warned' | 'recovered' | 'reconnecting' |
 *   'resumed' | 'ended'} LifecycleKind
 * @typedef {{kind: LifecycleKind, exp: number, code: number | null, meaning: string,
 *   detail: string, delay: number | null, error: TokendError | null,
 *   token: string | null, reason: string}} Lifecycle
 * @typedef {{code: number | null, detail: string, error?: TokendError | null,
 *   reason?: string, retryAfter?: number | null}} End
 */

// Where options.storage keeps a session's token and key, by tid.
const STORAGE_PREFIX = 'tokend:';

/**
 * A WebSocket class that is the npm package `ws`'s (an EventEmitter): under Node it
 * shows a refused handshake's response and takes TLS options, which the WebSocket
 * of browsers (and of Node 22) does not.
 */
function isNodeWs(WebSocketClass) {
  return typeof WebSocketClass?.prototype?.on === 'function';
}

/**
 * A tokend session held open over as many connections as it takes.
 *
 * `new Session(url, token, options)` only checks its arguments (an
 * {@link AuthError} for a token that is not a JWT with a UUID `jti` and an
 * integer `exp`, a `SyntaxError` for a URL that is not ws: or wss:). Nothing
 * connects before {@link Session#open} or {@link Session#start}.
 *
 * Always current: `token` (the newest token), `exp` (its expiry, epoch ms),
 * `tid`, `sub`, `state` ('ACTIVE' or 'WARN'), `heartbeatInterval` (ms, from
 * WELCOME), `connected`, `ended`, `error`, `stats`.
 *
 * Every HELLO after a WELCOME carries the resume proof made with that WELCOME's
 * session key. With `options.storage` (e.g. `sessionStorage`) the session keeps its
 * newest token and that key there, under `tokend:<tid>`, and a new Session of the
 * same token (after a page reload) takes both up again, so it still proves; the
 * entry is removed when the session ends.
 */
export class Session {
  /**
   * @param {string} url e.g. `wss://tokend.example/v1/ws`
   * @param {string} token
   * @param {import('./tokend.d.ts').SessionOptions} [options]
   */
  constructor(url, token, options = {}) {
    if (!/^wss?:$/.test(URL.canParse(url) ? new URL(url).protocol : '')) {
      throw new SyntaxError(`not a WebSocket URL: ${url}`);
    }
    const claims = tokenClaims(token);
    if (!globalThis.crypto?.subtle) {
      throw new TokendError(
        null,
        'WebCrypto (crypto.subtle) needs a secure context: https or localhost',
      );
    }
    this._ca = options.ca ?? null;
    if (this._ca !== null) {
      if (new URL(url).protocol !== 'wss:') throw new TypeError('the ca option is for wss:// URLs');
      if (!isNodeWs(globalThis.WebSocket)) {
        throw new TypeError(
          "the ca option needs the ws package's WebSocket (Node); a browser trusts its own CAs",
        );
      }
    }
    this.url = url;
    this.token = token;
    this.tid = claims.tid;
    this.sub = claims.sub;
    this.exp = claims.exp;
    /** @type {'ACTIVE' | 'WARN'} */
    this.state = 'ACTIVE';
    /** @type {number | null} */
    this.heartbeatInterval = null;
    /** @type {TokendError | null} */
    this.error = null;
    this.backoff =
      options.backoff instanceof Backoff ? options.backoff : new Backoff(options.backoff);
    this.openTimeout = options.openTimeout ?? 10_000;
    this.closeTimeout = options.closeTimeout ?? 5_000;
    this.stats = {
      heartbeats: 0, // heartbeats sent
      acks: 0, // heartbeat ACKs received
      renewals: 0, // ACKs that carried a renewed token
      reconnects: 0, // reconnect attempts scheduled
      lastRtt: null, // ms from the latest ACKed heartbeat to its ACK
      maxLag: 0, // the most ms a heartbeat was sent behind its schedule
    };
    /** @type {Lifecycle[]} the latest `history` changes */
    this.history = [];
    this._historySize = options.history ?? 256;
    this._tidBytes = tidBytes(this.tid);
    this._storage = options.storage ?? null;
    /** @type {Uint8Array | null} the session key of the last WELCOME */
    this._sessionKey = null;
    this._takeUpKept();
    /** @type {Promise<Uint8Array | null>} the proof for the next HELLO */
    this._proof = this._prove(this._sessionKey);
    this._spare = Infinity; // ms a reconnect after 1001 may wait at most (from WELCOME)
    this._listeners = new Map(LIFECYCLE.map((kind) => [kind, new Set()]));
    for (const [kind, callback] of Object.entries(options.on ?? {})) this.on(kind, callback);
    this._runner = null;
    this._conn = null; // the current connection
    this._live = false; // the current connection got its WELCOME
    this._welcomedOnce = false;
    this._healthy = false; // the current connection got a heartbeat ACK
    this._closing = false;
    this._paused = false;
    this._wake = null; // ends the backoff wait early (close)
    this._logout = null; // the promise of close(), once called
    this._settled = deferred(); // first WELCOME, or the end
    this._ended = deferred();
    this._onVisible = () => this._visibilityChanged();
  }

  // What options.storage keeps

  /** Take up the newest token and the session key kept for this tid, if any. */
  _takeUpKept() {
    const raw = this._storageCall('getItem', STORAGE_PREFIX + this.tid);
    if (typeof raw !== 'string') return;
    try {
      const kept = JSON.parse(raw);
      const claims = tokenClaims(kept.token);
      const key = fromHex(kept.key);
      if (claims.tid !== this.tid || key.length !== SESSION_KEY_LENGTH) return;
      if (claims.exp > this.exp) {
        this.token = kept.token;
        this.exp = claims.exp;
      }
      this._sessionKey = key;
    } catch {
      // Not ours, or damaged: the session starts without it.
    }
  }

  /**
   * The proof for the next HELLO, made with `key` (null: none). It is awaited before
   * the next connection, which reports a failure; none may follow (a logout).
   * @param {Uint8Array | null} key
   * @returns {Promise<Uint8Array | null>}
   */
  _prove(key) {
    const proof = key ? resumeProof(key, this._tidBytes) : Promise.resolve(null);
    proof.catch(() => {});
    return proof;
  }

  /** Keep the newest token and the session key, once a WELCOME gave one. */
  _keep() {
    if (!this._sessionKey) return;
    const value = JSON.stringify({ token: this.token, key: toHex(this._sessionKey) });
    this._storageCall('setItem', STORAGE_PREFIX + this.tid, value);
  }

  /** A storage that fails (full, forbidden) must not stop the session: say so and go on. */
  _storageCall(method, ...args) {
    if (!this._storage) return null;
    try {
      return this._storage[method](...args);
    } catch (exc) {
      console.warn(`tokend: storage.${method} failed`, exc);
      return null;
    }
  }

  /** True while a connection is open and welcomed. */
  get connected() {
    return this._live;
  }

  /** True once the session is over (see `error` for why). */
  get ended() {
    return this._ended.done;
  }

  /**
   * Call `callback(change)` on every change of `kind`; returns the unsubscribe function.
   * @param {LifecycleKind} kind
   * @param {(change: Lifecycle) => void} callback
   * @returns {() => void}
   */
  on(kind, callback) {
    const listeners = this._listeners.get(kind);
    if (!listeners) throw new TypeError(`unknown lifecycle kind ${kind}`);
    listeners.add(callback);
    return () => listeners.delete(callback);
  }

  /** Start connecting in the background; the callbacks report how it goes. */
  open() {
    if (this._runner) throw new Error('session already opened');
    globalThis.document?.addEventListener('visibilitychange', this._onVisible);
    this._runner = this._run();
  }

  /**
   * Open and wait for the first WELCOME; rejects with the error if the session ends first.
   * @returns {Promise<Session>}
   */
  async start() {
    this.open();
    await this._settled.promise;
    if (this.error) throw this.error;
    return this;
  }

  /** Wait until the session ends; rejects with its error unless it ended by close(). */
  async wait() {
    await this._ended.promise;
    if (this.error) throw this.error;
  }

  /**
   * Log out: send BYE and wait (up to `closeTimeout`) for the server's close.
   * Safe to call more than once. If no connection is open at that moment
   * (reconnecting), no BYE can be sent: the session is left on the server,
   * resumable until its clocks run out.
   */
  close() {
    if (!this._runner) return Promise.resolve();
    this._logout ??= this.ended ? this._runner : this._close();
    return this._logout;
  }

  async _close() {
    this._closing = true;
    this._wake?.();
    const conn = this._conn;
    let detail = this._unconnectedClose();
    if (conn && this._live) {
      detail = 'no close from the server after BYE; the session may stay until it expires';
      conn.ws.send(encodeBye());
      let timer = 0;
      const timeout = new Promise((resolve) => (timer = setTimeout(resolve, this.closeTimeout)));
      await Promise.race([this._ended.promise, timeout]);
      clearTimeout(timer);
    }
    if (!this.ended) {
      this._finish(null, detail);
      this._conn?.end({ code: null, detail }, 'closed by the client');
    }
    await this._runner;
  }

  /** What a close with no connection to send BYE on leaves behind. */
  _unconnectedClose() {
    if (!this._welcomedOnce) return 'closed before a session was made';
    return 'closed while not connected; the session stays until it expires';
  }

  /** Stop sending heartbeats (the server WARNs, then expires the session): tests, diagnostics. */
  pauseHeartbeats() {
    this._paused = true;
    if (this._conn) clearTimeout(this._conn.timer);
  }

  /** Send a heartbeat at once and keep the cadence again after {@link Session#pauseHeartbeats}. */
  resumeHeartbeats() {
    this._paused = false;
    const conn = this._conn;
    if (conn?.key) {
      conn.due = performance.now();
      this._beat(conn);
    }
  }

  // Reporting

  _emit(
    kind,
    { code = null, detail = '', delay = null, error = null, token = null, reason = '' } = {},
  ) {
    const meaning = kind === 'reconnecting' || kind === 'ended' ? describe(code) : '';
    /** @type {Lifecycle} */
    const change = { kind, exp: this.exp, code, meaning, detail, delay, error, token, reason };
    this.history.push(change);
    if (this.history.length > this._historySize) this.history.shift();
    for (const callback of this._listeners.get(kind)) {
      try {
        callback(change);
      } catch (exc) {
        // A failing callback must not stop the session.
        console.error('tokend: lifecycle callback failed', exc);
      }
    }
  }

  _finish(code, detail, error = null, reason = '') {
    if (this.ended) return;
    this.error = error;
    globalThis.document?.removeEventListener('visibilitychange', this._onVisible);
    this._storageCall('removeItem', STORAGE_PREFIX + this.tid);
    this._emit('ended', { code, detail, error, reason });
    this._ended.resolve();
    this._settled.resolve();
  }

  // The connection loop

  async _run() {
    let failures = 0; // attempts in a row that did not reach a heartbeat ACK
    try {
      while (!this.ended) {
        const proof = await this._proof;
        if (this.ended) return; // closed while the proof was being made
        const end = await this._connection(proof);
        if (this._closing) {
          this._finish(end.code, closingDetail(end), null, end.reason);
          return;
        }
        if (end.error) {
          this._finish(end.code, end.detail, end.error, end.reason);
          return;
        }
        if (this._healthy) failures = 0;
        const limit = this.backoff.maxAttempts;
        if (limit !== null && failures >= limit) {
          const reason = `gave up after ${failures} reconnect attempts; last: ${end.detail}`;
          this._finish(end.code, reason, new RetriesExhausted(end.code, reason), end.reason);
          return;
        }
        const delay = this._delay(end, failures);
        failures += 1;
        this.stats.reconnects += 1;
        this._emit('reconnecting', {
          code: end.code,
          detail: `${end.detail}; attempt ${failures} in ${(delay / 1000).toFixed(2)} s`,
          delay,
          reason: end.reason,
        });
        await new Promise((resolve) => {
          const timer = setTimeout(resolve, delay);
          this._wake = () => {
            clearTimeout(timer);
            resolve();
          };
        });
        this._wake = null;
        if (this._closing) this._finish(null, this._unconnectedClose());
      }
    } catch (exc) {
      // A bug here must end the session visibly, not hang it.
      this._finish(null, `client failure: ${exc}`, new TokendError(null, String(exc)));
    }
  }

  /** The wait before reconnect attempt `attempt` after `end`, ms ({@link Backoff}). */
  _delay(end, attempt) {
    if (end.retryAfter != null) return this.backoff.afterRefusal(attempt, end.retryAfter);
    if (end.code === CloseCode.GOING_AWAY) {
      return this.backoff.afterGoingAway(attempt, this._spare);
    }
    return this.backoff.delay(attempt);
  }

  /**
   * One connection: handshake, HELLO (with `proof` if any), then frames until it closes.
   * @param {Uint8Array | null} proof
   * @returns {Promise<End>}
   */
  _connection(proof) {
    this._healthy = false;
    return new Promise((resolve) => {
      const ws =
        this._ca === null
          ? new WebSocket(this.url, [SUBPROTOCOL])
          : new WebSocket(this.url, [SUBPROTOCOL], { ca: this._ca });
      ws.binaryType = 'arraybuffer';
      const conn = {
        ws,
        opened: false,
        refusal: null, // {status, retryAfter}: the HTTP answer to a refused handshake (ws)
        failure: '', // why the socket failed, where the WebSocket says (not browsers)
        welcome: null,
        key: null, // the session key as a CryptoKey, once imported
        seq: 0,
        sent: new Map(), // seq -> performance.now() when sent, until ACKed
        due: 0, // when the next heartbeat is due (performance.now() time)
        timer: 0,
        openTimer: 0, // ends a connection that gets no WELCOME within openTimeout
        signing: false,
        done: false,
        /**
         * Settle this connection once; `closeReason` closes the socket when it is still up.
         * @param {End} result
         * @param {string} [closeReason]
         */
        end: (result, closeReason) => {
          if (conn.done) return;
          conn.done = true;
          clearTimeout(conn.openTimer);
          clearTimeout(conn.timer);
          ws.onopen = ws.onmessage = ws.onclose = null;
          // Not null: ws (the WebSocket under Node 20) throws an error nobody listens to,
          // as it does when closed before its handshake is done.
          ws.onerror = () => {};
          if (closeReason !== undefined && ws.readyState <= WebSocket.OPEN) {
            const code = result.error instanceof ProtocolViolation ? CLIENT_VIOLATION_CODE : 1000;
            ws.close(code, closeReason);
          }
          if (this._conn === conn) this._conn = null;
          this._live = false;
          resolve(result);
        },
      };
      this._conn = conn;
      conn.openTimer = setTimeout(
        () => conn.end({ code: null, detail: 'no WELCOME in time' }, 'no WELCOME in time'),
        this.openTimeout,
      );
      ws.onopen = () => {
        conn.opened = true;
        if (ws.protocol !== SUBPROTOCOL) {
          const detail = `the server did not select subprotocol ${SUBPROTOCOL}`;
          conn.end(
            { code: null, detail, error: new ProtocolViolation(null, detail) },
            'protocol error',
          );
          return;
        }
        ws.send(encodeHello(this.token, proof));
      };
      ws.onmessage = (event) => {
        try {
          this._handle(conn, event.data);
        } catch (exc) {
          this._fail(conn, exc);
        }
      };
      ws.onclose = (event) => conn.end(this._closed(conn, event));
      // A close event follows, with the code; under Node the error says why.
      ws.onerror = (event) => {
        conn.failure = typeof event?.message === 'string' ? event.message : '';
      };
      // Under Node, ws shows the response to a refused handshake (browsers hide it):
      // taken, the handshake must be ended here; a close event 1006 follows.
      ws.on?.('unexpected-response', (_request, response) => {
        conn.refusal = {
          status: response.statusCode,
          retryAfter: retryAfterMs(response.headers['retry-after']),
        };
        ws.terminate();
      });
    });
  }

  /**
   * How a close event ends the connection.
   * @returns {End}
   */
  _closed(conn, event) {
    if (event.code === ABNORMAL_CLOSURE) {
      // Browsers hide why a handshake failed (refused, HTTP 4xx/5xx): all are retried.
      if (conn.refusal) {
        const { status, retryAfter } = conn.refusal;
        return { code: null, detail: `HTTP ${status} at the opening handshake`, retryAfter };
      }
      if (conn.opened) return { code: null, detail: 'connection lost' };
      const detail = conn.failure ? `cannot connect: ${conn.failure}` : 'cannot connect';
      return { code: null, detail };
    }
    const { code, reason } = event;
    const family = classify(code);
    return { code, detail: describe(code), error: family ? new family(code, reason) : null, reason };
  }

  /** End the connection on a malformed server frame (terminal) or a bug of ours (visible). */
  _fail(conn, exc) {
    const violation = exc instanceof ProtocolError;
    const error = violation
      ? new ProtocolViolation(null, exc.message)
      : new TokendError(null, `client failure: ${exc}`);
    conn.end(
      { code: null, detail: error.message, error },
      violation ? 'protocol error' : 'client failure',
    );
  }

  // Frames

  _handle(conn, data) {
    if (typeof data === 'string') throw new ProtocolError('text message');
    const frame = decodeServerFrame(data);
    if (!conn.welcome) {
      if (frame.type !== 'welcome') throw new ProtocolError(`expected WELCOME, got ${frame.type}`);
      if (!sameBytes(frame.tid, this._tidBytes))
        throw new ProtocolError('WELCOME names another tid');
      this._welcome(conn, frame);
    } else if (frame.type === 'ack') {
      this._ack(conn, frame);
    } else if (frame.type === 'notice') {
      this.state = 'WARN';
      this._emit('warned', { detail: 'the server missed our heartbeats' });
    } else {
      throw new ProtocolError(`unexpected ${frame.type}`);
    }
  }

  _welcome(conn, welcome) {
    clearTimeout(conn.openTimer); // in time: from here on heartbeat ACKs judge the link
    conn.welcome = welcome;
    this._sessionKey = welcome.sessionKey;
    this._proof = this._prove(welcome.sessionKey);
    this._keep();
    // The most a first reconnect after 1001 may wait: half of what the session has
    // left at worst when the close comes (expire_after, less the heartbeat interval it
    // may already be behind), so that a spread reconnect cannot expire it.
    this._spare = (welcome.expireMs - welcome.heartbeatMs) / 2;
    this.heartbeatInterval = welcome.heartbeatMs;
    this.state = 'ACTIVE';
    this._live = true;
    if (!this._welcomedOnce) {
      this._welcomedOnce = true;
      const detail = welcome.resumed ? 'resumed an existing session' : 'new session';
      this._emit('connected', { detail });
    } else if (welcome.resumed) {
      this._emit('resumed', { detail: 'the same session goes on' });
    } else {
      this._emit('connected', { detail: 'the server no longer had the session: new one' });
    }
    this._settled.resolve();
    importSessionKey(welcome.sessionKey).then(
      (key) => {
        conn.key = key;
        conn.due = performance.now(); // the first heartbeat goes right after WELCOME
        this._beat(conn);
      },
      (exc) => this._fail(conn, exc),
    );
  }

  _ack(conn, ack) {
    const sentAt = conn.sent.get(ack.seq);
    if (sentAt !== undefined) this.stats.lastRtt = performance.now() - sentAt;
    for (const seq of conn.sent.keys()) if (seq <= ack.seq) conn.sent.delete(seq);
    this.stats.acks += 1;
    this._healthy = true;
    if (ack.wasWarn || this.state === 'WARN') {
      this.state = 'ACTIVE';
      this._emit('recovered', { detail: 'heartbeat accepted, session ACTIVE again' });
    }
    if (ack.token === null) return;
    let claims;
    try {
      claims = tokenClaims(ack.token);
    } catch (exc) {
      throw new ProtocolError(`ACK token unreadable: ${exc.reason}`);
    }
    if (claims.tid !== this.tid) throw new ProtocolError('ACK token names another tid');
    this.token = ack.token;
    this.exp = claims.exp;
    this._keep();
    if (ack.renewed) this.stats.renewals += 1;
    const detail = ack.renewed ? 'renewed' : 'token re-sent (we held an older one)';
    this._emit('renewed', { detail, token: ack.token });
  }

  // Heartbeats

  /**
   * Send one heartbeat if it is due, then schedule the next; drop the link if ACKs stop.
   *
   * The schedule is absolute: a late wake-up (a throttled background tab, a busy
   * main thread) sends one heartbeat at once and restarts the cadence from there;
   * it never sends a burst. One heartbeat is signed at a time, so `seq` reaches
   * the server in order.
   */
  async _tick(conn) {
    clearTimeout(conn.timer);
    if (conn.done || this._closing || this._paused || conn.signing) return;
    const now = performance.now();
    const { heartbeatMs, warnMs } = conn.welcome;
    if (now < conn.due) {
      this._schedule(conn);
      return;
    }
    const lag = now - conn.due;
    this.stats.maxLag = Math.max(this.stats.maxLag, lag);
    const oldest = conn.sent.values().next().value;
    // After a late wake-up the ACKs that came meanwhile may not have been read
    // yet: judge silence only on a tick that is on time.
    if (oldest !== undefined && lag < heartbeatMs / 2 && now - oldest > warnMs) {
      const detail = `no heartbeat ACK for ${warnMs / 1000} s`;
      conn.end({ code: null, detail }, detail);
      return;
    }
    conn.seq += 1;
    const seq = conn.seq;
    conn.sent.set(seq, now);
    this.stats.heartbeats += 1;
    conn.due += heartbeatMs;
    if (conn.due <= now) conn.due = now + heartbeatMs;
    conn.signing = true;
    let frame;
    try {
      frame = await encodeHeartbeat(conn.key, this._tidBytes, seq, this.exp);
    } finally {
      conn.signing = false;
    }
    if (conn.done || this._closing) return;
    conn.ws.send(frame);
    this._schedule(conn);
  }

  _beat(conn) {
    this._tick(conn).catch((exc) => this._fail(conn, exc));
  }

  _schedule(conn) {
    clearTimeout(conn.timer);
    if (this._paused || conn.done) return;
    conn.timer = setTimeout(() => this._beat(conn), Math.max(0, conn.due - performance.now()));
  }

  /** A tab coming back to the foreground sends a heartbeat at once if one is due or overdue. */
  _visibilityChanged() {
    const conn = this._conn;
    if (
      globalThis.document?.visibilityState === 'visible' &&
      conn?.key &&
      performance.now() >= conn.due
    ) {
      this._beat(conn);
    }
  }
}

function closingDetail(end) {
  if (end.code === CloseCode.NORMAL) return 'logged out (BYE)';
  return `closed during logout: ${end.detail}; the session stays until it expires`;
}

function deferred() {
  const result = { done: false };
  result.promise = new Promise((resolve) => {
    result.resolve = () => {
      result.done = true;
      resolve();
    };
  });
  return result;
}

/**
 * Open a session and wait for its first WELCOME (rejects with the {@link TokendError}
 * if it cannot start: refused token, attempts used up).
 * @param {string} url
 * @param {string} token
 * @param {import('./tokend.d.ts').SessionOptions} [options]
 * @returns {Promise<Session>}
 */
export function connect(url, token, options = {}) {
  return new Session(url, token, options).start();
}
