// Types of the tokend browser SDK (tokend.js), protocol v1. Usage: README.md beside it.

export declare const VERSION: 1;
export declare const SUBPROTOCOL: 'tokend.v1';
export declare const WS_PATH: '/v1/ws';
export declare const MAX_TOKEN_LENGTH: 8192;

export declare const FrameType: Readonly<{
  HELLO: 0x01;
  WELCOME: 0x02;
  HEARTBEAT: 0x03;
  HEARTBEAT_ACK: 0x04;
  BYE: 0x05;
  NOTICE: 0x06;
}>;

/** Close codes of the spec's table "Close codes". */
export declare const CloseCode: Readonly<{
  NORMAL: 1000;
  GOING_AWAY: 1001;
  MESSAGE_TOO_BIG: 1009;
  INTERNAL_ERROR: 1011;
  TRY_AGAIN_LATER: 1013;
  HELLO_TIMEOUT: 4008;
  RATE_LIMITED: 4029;
  INVALID_TOKEN: 4501;
  TOKEN_EXPIRED: 4502;
  PROTOCOL_ERROR: 4503;
  BAD_HEARTBEAT: 4504;
  SESSION_EXPIRED: 4505;
  TOKEN_REVOKED: 4506;
  TAKEN_OVER: 4507;
  SESSION_IN_USE: 4509;
}>;

/** 1001, 1011, 1013, 4008, 4029, 4509: the codes that invite a reconnect. */
export declare const RECONNECTABLE: ReadonlySet<number>;

export type LifecycleKind =
  'connected' | 'renewed' | 'warned' | 'recovered' | 'reconnecting' | 'resumed' | 'ended';

export declare const LIFECYCLE: readonly LifecycleKind[];

/** One change of a session's life, as passed to the lifecycle callbacks. */
export interface Lifecycle {
  kind: LifecycleKind;
  /** Expiry (epoch ms) of the token the client holds at that point. */
  exp: number;
  /** The close code behind a 'reconnecting' or 'ended' change; null: no close frame. */
  code: number | null;
  /** The close code in words, for 'reconnecting' and 'ended' changes; '' otherwise. */
  meaning: string;
  detail: string;
  /** Milliseconds before the next attempt, for a 'reconnecting' change. */
  delay: number | null;
  /** Why an 'ended' session ended; null after close() (logout). */
  error: TokendError | null;
  /** The new token of a 'renewed' change. */
  token: string | null;
  /**
   * The close frame's reason behind a 'reconnecting' or 'ended' change: tokend's are
   * stable words (docs/protocol.md §7, e.g. 'bad_signature'); '' when there was none.
   */
  reason: string;
}

export type LifecycleCallbacks = Partial<Record<LifecycleKind, (change: Lifecycle) => void>>;

export interface BackoffOptions {
  /** ms; attempt n waits uniform(0, min(cap, base * 2**n)). Default 500. */
  base?: number;
  /** ms. Default 30000. */
  cap?: number;
  /** Failed attempts in a row before giving up (RetriesExhausted); null: no limit. */
  maxAttempts?: number | null;
  /**
   * ms: after a close 1001 (the server drains, reloads or stops) the first reconnect
   * waits uniform(0, goingAwayWindow), at most half of what the session can spare
   * (expire_after less the heartbeat interval, from WELCOME). Default 5000.
   */
  goingAwayWindow?: number;
}

/** Where a session keeps its newest token and session key: `sessionStorage` fits. */
export interface SessionStorageLike {
  getItem(key: string): string | null;
  setItem(key: string, value: string): void;
  removeItem(key: string): void;
}

export interface SessionOptions {
  on?: LifecycleCallbacks;
  backoff?: Backoff | BackoffOptions;
  /** ms from opening a connection to its WELCOME before it is dropped. Default 10000. */
  openTimeout?: number;
  /** ms close() waits for the server's close after BYE. Default 5000. */
  closeTimeout?: number;
  /** How many changes `history` keeps. Default 256. */
  history?: number;
  /**
   * Keeps the newest token and the last WELCOME's session key under `tokend:<tid>`, so
   * that a new Session of the same token (after a page reload) still proves its resume;
   * removed when the session ends. Default: nothing kept.
   */
  storage?: SessionStorageLike | null;
  /**
   * CA certificates (PEM) to trust for a wss:// URL, under Node with the `ws` package's
   * WebSocket (passed as its `ca` option). Browsers trust their own CAs: refused there.
   */
  ca?: string | Uint8Array | Array<string | Uint8Array>;
}

export interface SessionStats {
  /** Heartbeats sent. */
  heartbeats: number;
  /** Heartbeat ACKs received. */
  acks: number;
  /** ACKs that carried a renewed token. */
  renewals: number;
  /** Reconnect attempts scheduled. */
  reconnects: number;
  /** ms from the latest ACKed heartbeat to its ACK. */
  lastRtt: number | null;
  /** The most ms a heartbeat was sent behind its schedule. */
  maxLag: number;
}

export declare class Backoff {
  constructor(options?: BackoffOptions);
  readonly base: number;
  readonly cap: number;
  readonly maxAttempts: number | null;
  readonly goingAwayWindow: number;
  /** The longest wait of attempt `attempt`, ms. */
  ceiling(attempt: number): number;
  /** A random wait for attempt `attempt`, ms. */
  delay(attempt: number): number;
  /** The wait after a close 1001, ms: uniform over min(goingAwayWindow, limit), or longer. */
  afterGoingAway(attempt: number, limit?: number): number;
  /** The wait after an HTTP refusal with Retry-After (ms): at least that, jittered. */
  afterRefusal(attempt: number, retryAfter: number): number;
}

/** Why a session ended for good; `code` null when no close frame decided. */
export declare class TokendError extends Error {
  constructor(code: number | null, reason?: string);
  readonly code: number | null;
  /**
   * The close frame's reason when `code` is set: tokend's are stable words
   * (docs/protocol.md §7, e.g. 'bad_signature'); else what went wrong, in words.
   */
  readonly reason: string;
  /** The close code in words, e.g. "token revoked"; the reason when there is no code. */
  readonly meaning: string;
}
/** 4501 invalid token, 4502 token expired at HELLO, or a token that is not a JWT. */
export declare class AuthError extends TokendError {}
/** 4505 session expired. */
export declare class SessionExpired extends TokendError {}
/** 4506 token revoked (or logged out elsewhere). */
export declare class Revoked extends TokendError {}
/** 4507 session taken over by a newer connection. */
export declare class TakenOver extends Revoked {}
/** 1009, 4503, 4504, a malformed server frame, no `tokend.v1` subprotocol. */
export declare class ProtocolViolation extends TokendError {}
/** `maxAttempts` reconnect attempts in a row failed. */
export declare class RetriesExhausted extends TokendError {}
/** A server message that is not a well-formed protocol v1 frame. */
export declare class ProtocolError extends Error {}

export declare function describe(code: number | null): string;
/** The error class a close ends the session with; null when it invites a reconnect. */
export declare function classify(code: number | null): typeof TokendError | null;
/** `{tid, sub, exp (ms)}` read from a token without verifying it. */
export declare function tokenClaims(token: string): { tid: string; sub: string; exp: number };

export interface Welcome {
  type: 'welcome';
  tid: Uint8Array;
  expMs: number;
  heartbeatMs: number;
  warnMs: number;
  expireMs: number;
  sessionKey: Uint8Array;
  resumed: boolean;
}
export interface HeartbeatAck {
  type: 'ack';
  seq: number;
  expMs: number;
  token: string | null;
  renewed: boolean;
  resent: boolean;
  wasWarn: boolean;
}
export interface Notice {
  type: 'notice';
  state: 'WARN';
}

export declare function encodeHello(token: string, proof?: Uint8Array | null): Uint8Array;
/** The 16-byte resume proof of HELLO (spec "Resume proof", revision 2). */
export declare function resumeProof(sessionKey: Uint8Array, tid: Uint8Array): Promise<Uint8Array>;
export declare function encodeBye(): Uint8Array;
export declare function importSessionKey(sessionKey: Uint8Array): Promise<CryptoKey>;
export declare function encodeHeartbeat(
  key: CryptoKey,
  tid: Uint8Array,
  seq: number,
  expMs: number,
): Promise<Uint8Array>;
export declare function decodeServerFrame(data: ArrayBuffer): Welcome | HeartbeatAck | Notice;

/** A tokend session held open over as many connections as it takes. */
export declare class Session {
  constructor(url: string, token: string, options?: SessionOptions);
  readonly url: string;
  /** The newest token: hand it to whoever needs one. */
  readonly token: string;
  /** The token id (the jti claim), canonical UUID string. */
  readonly tid: string;
  readonly sub: string;
  /** Expiry of the newest token, epoch ms. */
  readonly exp: number;
  readonly state: 'ACTIVE' | 'WARN';
  /** ms, from WELCOME; null before the first one. */
  readonly heartbeatInterval: number | null;
  readonly error: TokendError | null;
  readonly backoff: Backoff;
  readonly stats: SessionStats;
  /** The latest changes, oldest first. */
  readonly history: Lifecycle[];
  /** True while a connection is open and welcomed. */
  readonly connected: boolean;
  /** True once the session is over. */
  readonly ended: boolean;
  /** Subscribe to one kind of change; returns the unsubscribe function. */
  on(kind: LifecycleKind, callback: (change: Lifecycle) => void): () => void;
  /** Start connecting in the background. */
  open(): void;
  /** Open and wait for the first WELCOME; rejects with the TokendError if it ends first. */
  start(): Promise<Session>;
  /** Wait until the session ends; rejects with its error unless it ended by close(). */
  wait(): Promise<void>;
  /** Log out: BYE, then wait for the server's close. */
  close(): Promise<void>;
  /** Stop sending heartbeats (the server will WARN, then expire the session). */
  pauseHeartbeats(): void;
  /** Send a heartbeat now and keep the cadence again. */
  resumeHeartbeats(): void;
}

/** Open a session and wait for its first WELCOME. */
export declare function connect(
  url: string,
  token: string,
  options?: SessionOptions,
): Promise<Session>;
