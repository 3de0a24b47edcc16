// The tokend live dashboard: polls the admin listener's /v1/stats and /v1/events
// (docs/operations.md) and draws them. No framework, no build step.
//
// Auth: the admin token comes from the form, or from the URL fragment
// (#token=...; a fragment never reaches a server), is kept in sessionStorage
// (this tab only) and sent as `Authorization: Bearer`; it is never put in a URL
// query. The fragment may also carry poll=<ms> (default 1000).

const TOKEN_KEY = 'tokend-admin-token';
const DEFAULT_POLL_MS = 1000;
const MIN_POLL_MS = 100;
const CHART_SAMPLES = 300; // points kept for the chart
const EVENT_ROWS = 200; // rows kept in the event feed
const EVENTS_PAGE = 500; // the listener's largest page
// Event fields with a column of their own; any other field goes to "detail".
const EVENT_COLUMNS = new Set(['v', 'seq', 'type', 'tid', 'sub', 'at', 'node']);
const CHART = { width: 600, height: 160, pad: 4 };

const $ = (selector) => document.querySelector(selector);

const state = {
  token: null,
  pollMs: DEFAULT_POLL_MS,
  timer: 0,
  after: 0, // the `next` of the latest /v1/events answer
  heartbeats: 0, // heartbeats_total of the latest /v1/stats answer
  unreachable: false, // the latest poll failed
  samples: [], // {at, ACTIVE, WARN}
};

/** Token and poll interval from the fragment, then the fragment wiped from the URL. */
function readFragment() {
  const params = new URLSearchParams(location.hash.slice(1));
  const poll = Number(params.get('poll'));
  if (Number.isFinite(poll) && poll >= MIN_POLL_MS) state.pollMs = poll;
  const token = params.get('token');
  if (token) sessionStorage.setItem(TOKEN_KEY, token);
  if (location.hash) history.replaceState(null, '', location.pathname);
}

class Unauthorized extends Error {}

async function api(path) {
  const response = await fetch(path, {
    headers: { Authorization: `Bearer ${state.token}` },
    cache: 'no-store',
  });
  if (response.status === 401) throw new Unauthorized('wrong admin token');
  if (!response.ok) {
    const body = await response.json().catch(() => ({}));
    throw new Error(`${path}: HTTP ${response.status} ${body.error ?? ''}`.trim());
  }
  return response.json();
}

function setStatus(text, isError = false) {
  const status = $('#status');
  status.textContent = text;
  status.classList.toggle('error', isError);
}

function showLogin(message = '') {
  clearTimeout(state.timer);
  state.token = null;
  $('#board').hidden = true;
  $('#forget').hidden = true;
  $('#login').hidden = false;
  $('#login-error').textContent = message;
  setStatus('not connected');
  $('#token').focus();
}

function start(token) {
  state.token = token;
  state.after = 0;
  state.heartbeats = 0;
  state.samples = [];
  $('#events tbody').replaceChildren();
  $('#login').hidden = true;
  $('#board').hidden = false;
  $('#forget').hidden = false;
  poll();
}

async function poll() {
  clearTimeout(state.timer);
  try {
    const stats = await api('/v1/stats');
    // The event ring numbers from 1 again in a new process. A node that was away, or
    // whose counters went back, may be one: read its whole ring again (the rows
    // shown are not repeated).
    if (state.unreachable || stats.heartbeats_total < state.heartbeats) state.after = 0;
    state.heartbeats = stats.heartbeats_total;
    const feed = await api(`/v1/events?after=${state.after}&limit=${EVENTS_PAGE}`);
    renderStats(stats);
    renderEvents(feed);
    setStatus(`updated ${clock(stats.at)}, every ${state.pollMs / 1000} s`);
    state.unreachable = false;
  } catch (error) {
    if (error instanceof Unauthorized) {
      sessionStorage.removeItem(TOKEN_KEY);
      showLogin('The admin listener refused this token (401).');
      return;
    }
    setStatus(`admin API unreachable: ${error.message}`, true);
    state.unreachable = true;
  }
  state.timer = setTimeout(poll, state.pollMs);
}

// Rendering: textContent only, never HTML, since event fields come from tokens.

function clock(ms) {
  return new Date(ms).toLocaleTimeString([], { hour12: false });
}

function number(value) {
  return typeof value === 'number' ? value.toLocaleString('en-US') : '–';
}

function setStat(name, value) {
  $(`[data-stat="${name}"]`).textContent = number(value);
}

function fillTable(selector, rows) {
  const body = $(`${selector} tbody`);
  body.replaceChildren(
    ...rows.map((cells) => {
      const tr = document.createElement('tr');
      tr.dataset.key = cells[0];
      for (const cell of cells) tr.insertCell().textContent = cell;
      return tr;
    }),
  );
}

function latencyRows(summaries) {
  // No samples yet: no percentile to show.
  const ms = (value, count) => (count ? value.toFixed(3) : '–');
  return Object.entries(summaries).map(([name, s]) => [
    name,
    ms(s.p50, s.count),
    ms(s.p95, s.count),
    number(s.count),
  ]);
}

function renderStats(stats) {
  $('#node').textContent = `node ${stats.node}`;
  for (const name of ['ACTIVE', 'WARN']) setStat(`sessions.${name}`, stats.sessions[name]);
  for (const name of ['sessions_total', 'connections', 'heartbeats_total', 'renewals_total']) {
    setStat(name, stats[name]);
  }
  const expiries = Object.values(stats.expiries_total).reduce((sum, n) => sum + n, 0);
  setStat('expiries', expiries);
  fillTable('#stages', latencyRows(stats.heartbeat_stage_ms));
  fillTable('#redis', latencyRows(stats.redis_ms));
  fillTable(
    '#close-codes',
    Object.entries(stats.close_codes).map(([c, n]) => [c, number(n)]),
  );
  fillTable(
    '#expiries',
    Object.entries(stats.expiries_total).map(([r, n]) => [r, number(n)]),
  );
  state.samples.push({ at: stats.at, ...stats.sessions });
  if (state.samples.length > CHART_SAMPLES) state.samples.shift();
  renderChart();
}

function renderChart() {
  const { samples } = state;
  const max = Math.max(1, ...samples.flatMap((s) => [s.ACTIVE, s.WARN]));
  const first = samples[0].at;
  const span = Math.max(1, samples.at(-1).at - first);
  const { width, height, pad } = CHART;
  for (const line of document.querySelectorAll('#chart polyline')) {
    const series = line.dataset.series;
    const points = samples.map((s) => {
      const x = ((s.at - first) / span) * width;
      const y = height - pad - (s[series] / max) * (height - 2 * pad);
      return `${x.toFixed(1)},${y.toFixed(1)}`;
    });
    line.setAttribute('points', points.join(' '));
  }
  $('#chart-max').textContent = number(max);
  const seconds = span / 1000;
  $('#chart-span').textContent =
    `(last ${seconds < 10 ? seconds.toFixed(1) : Math.round(seconds)} s)`;
}

function renderEvents(feed) {
  state.after = feed.next;
  const body = $('#events tbody');
  for (const event of feed.events) {
    const key = `${event.node} ${event.at} ${event.type} ${event.tid}`;
    if (body.querySelector(`tr[data-key="${CSS.escape(key)}"]`)) continue; // shown already
    const tr = document.createElement('tr');
    tr.dataset.key = key;
    tr.dataset.type = event.type;
    tr.dataset.tid = event.tid;
    tr.className = event.type.toLowerCase();
    const detail = Object.entries(event)
      .filter(([key]) => !EVENT_COLUMNS.has(key))
      .map(([key, value]) => `${key}=${value}`)
      .join(' ');
    const tid = `${event.tid.slice(0, 8)}…`;
    for (const cell of [
      clock(event.at),
      event.type,
      event.sub ?? '',
      tid,
      event.node ?? '',
      detail,
    ]) {
      tr.insertCell().textContent = cell;
    }
    tr.cells[3].title = event.tid;
    body.prepend(tr);
  }
  while (body.rows.length > EVENT_ROWS) body.lastElementChild.remove();
}

$('#login').addEventListener('submit', (event) => {
  event.preventDefault();
  const token = $('#token').value.trim();
  $('#token').value = '';
  sessionStorage.setItem(TOKEN_KEY, token);
  start(token);
});

$('#forget').addEventListener('click', () => {
  sessionStorage.removeItem(TOKEN_KEY);
  showLogin();
});

readFragment();
const saved = sessionStorage.getItem(TOKEN_KEY);
if (saved) start(saved);
else showLogin();
