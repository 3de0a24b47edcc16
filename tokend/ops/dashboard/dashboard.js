// The tokend live dashboard: polls the admin listener's /v1/stats, /v1/nodes,
// /v1/history and /v1/events (docs/operations.md) and draws them. No framework, no
// build step.
//
// Auth: the admin token comes from the form, or from the URL fragment
// (#token=...; a fragment never reaches a server), is kept in sessionStorage
// (this tab only) and sent as `Authorization: Bearer`; it is never put in a URL
// query. The fragment may also carry poll=<ms> (default 1000) and node=<name|all>.

const TOKEN_KEY = 'tokend-admin-token';
const DEFAULT_POLL_MS = 1000;
const MIN_POLL_MS = 100;
const EVENT_ROWS = 200; // rows kept in the event feed
const EVENTS_PAGE = 500; // the listener's largest page
const ALL = 'all';
// Event fields with a column of their own; any other field goes to "detail".
const EVENT_COLUMNS = new Set(['v', 'seq', 'type', 'tid', 'sub', 'at', 'node']);
const SVG = 'http://www.w3.org/2000/svg';
const PLOT = { width: 800, height: 190, left: 52, right: 12, top: 10, bottom: 24 };
const X_TICKS = 5;
const ENDED = [
  ['expired', 'EXPIRED'],
  ['revoked', 'REVOKED'],
  ['closed', 'CLOSED (BYE)'],
];

const $ = (selector, root = document) => root.querySelector(selector);

const state = {
  token: null,
  pollMs: DEFAULT_POLL_MS,
  timer: 0,
  after: 0, // the `next` of the latest /v1/events answer
  heartbeats: 0, // heartbeats_total of the latest /v1/stats answer
  unreachable: false, // the latest poll failed
  self: null, // the name of the node serving this page
  shown: null, // the node shown: a name, or ALL
  history: [], // samples of the node shown, oldest first
  historyOf: null, // whose they are
  historyAt: 0, // when they were fetched (Date.now())
  interval: 10, // seconds between two samples
  nodes: [], // the latest /v1/nodes answer
  polling: false, // a poll is under way
  again: false, // poll again as soon as it ends
};

/** Token, poll interval and node from the fragment, then the fragment wiped from the URL. */
function readFragment() {
  const params = new URLSearchParams(location.hash.slice(1));
  const poll = Number(params.get('poll'));
  if (Number.isFinite(poll) && poll >= MIN_POLL_MS) state.pollMs = poll;
  const token = params.get('token');
  if (token) sessionStorage.setItem(TOKEN_KEY, token);
  if (params.get('node')) state.shown = params.get('node');
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
  $('#node-picker').hidden = true;
  $('#login').hidden = false;
  $('#login-error').textContent = message;
  setStatus('not connected');
  $('#token').focus();
}

function start(token) {
  state.token = token;
  state.after = 0;
  state.heartbeats = 0;
  state.history = [];
  state.historyOf = null;
  $('#events tbody').replaceChildren();
  $('#login').hidden = true;
  $('#board').hidden = false;
  $('#forget').hidden = false;
  poll();
}

async function poll() {
  clearTimeout(state.timer);
  if (state.polling) {
    state.again = true; // a node was chosen meanwhile: poll once this one ends
    return;
  }
  state.polling = true;
  try {
    const stats = await api('/v1/stats');
    // The event ring numbers from 1 again in a new process. A node that was away, or
    // whose counters went back, may be one: read its whole ring again (the rows
    // shown are not repeated).
    if (state.unreachable || stats.heartbeats_total < state.heartbeats) state.after = 0;
    state.heartbeats = stats.heartbeats_total;
    state.self = stats.node;
    state.shown ??= stats.node;
    state.interval = stats.history_interval;
    const [feed, nodes] = await Promise.all([
      api(`/v1/events?after=${state.after}&limit=${EVENTS_PAGE}`),
      api('/v1/nodes'),
    ]);
    state.nodes = nodes.nodes;
    await fetchHistory();
    render(stats);
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
  } finally {
    state.polling = false;
  }
  state.timer = setTimeout(poll, state.again ? 0 : state.pollMs);
  state.again = false;
}

/** The samples of the node shown: all of them when it changed, then those after the
 * last one, at most once an interval. Every node's added up ("all") are read whole each
 * time: a moment's sum grows as each node's sample of it comes. */
async function fetchHistory() {
  const node = state.shown;
  const changed = state.historyOf !== node;
  if (!changed && Date.now() - state.historyAt < state.interval * 1000) return;
  const after = changed || node === ALL ? 0 : (state.history.at(-1)?.at ?? 0);
  const answer = await api(`/v1/history?node=${encodeURIComponent(node)}&after=${after}`);
  state.history = after ? state.history.concat(answer.samples) : answer.samples;
  state.historyOf = node;
  state.historyAt = Date.now();
}

function show(node) {
  state.shown = node;
  poll();
}

// Rendering: textContent only, never HTML, since event fields come from tokens.

function clock(ms, tenths = false) {
  const time = new Date(ms).toLocaleTimeString([], { hour12: false });
  return tenths ? `${time}.${Math.floor((ms % 1000) / 100)}` : time;
}

function number(value, digits = 0) {
  if (typeof value !== 'number') return '–';
  return value.toLocaleString('en-US', { maximumFractionDigits: digits });
}

function setStat(name, value, digits = 0) {
  $(`[data-stat="${name}"]`).textContent = number(value, digits);
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
  return body;
}

function latencyRows(summaries) {
  // No samples yet: no percentile to show.
  const ms = (value, count) => (count ? value.toFixed(3) : '–');
  return Object.entries(summaries ?? {}).map(([name, s]) => [
    name,
    ms(s.p50, s.count),
    ms(s.p95, s.count),
    number(s.count),
  ]);
}

function sum(values) {
  return values.reduce((total, n) => total + (n ?? 0), 0);
}

function added(objects) {
  const total = {};
  for (const object of objects) {
    for (const [key, n] of Object.entries(object ?? {})) total[key] = (total[key] ?? 0) + n;
  }
  return total;
}

/** Every node's views as one (ALL): their counts and rates added up. */
function allNodes(views) {
  return {
    node: ALL,
    connections: sum(views.map((v) => v.connections)),
    held: added(views.map((v) => v.held)),
    rates: {
      heartbeats: sum(views.map((v) => v.rates?.heartbeats)),
      renewals: sum(views.map((v) => v.rates?.renewals)),
      expiries: sum(views.map((v) => v.rates?.expiries)),
    },
    close_codes: added(views.map((v) => v.close_codes)),
    expiries_total: added(views.map((v) => v.expiries_total)),
  };
}

/** The view of the node shown (null: it is gone), and the nodes its health is of. */
function shownView(stats) {
  const others = state.nodes.filter((v) => v.node !== stats.node);
  const views = [stats, ...others].sort((a, b) => a.node.localeCompare(b.node));
  if (state.shown === ALL) return [allNodes(views), views];
  const view = views.find((v) => v.node === state.shown) ?? null;
  return [view, view ? [view] : []];
}

function render(stats) {
  $('#node').textContent = `served by ${stats.node}`;
  renderCluster(stats.cluster);
  renderPicker(stats.node);
  const [view, healthOf] = shownView(stats);
  const name =
    state.shown === ALL
      ? 'All nodes'
      : state.shown === stats.node
        ? `This node (${stats.node})`
        : `Node ${state.shown}`;
  $('#shown-title').textContent = view ? name : `${name}: not seen for a while`;
  for (const element of document.querySelectorAll('.shown-name')) element.textContent = name;
  setStat('connections', view?.connections);
  setStat('held.ACTIVE', view?.held?.ACTIVE);
  setStat('held.WARN', view?.held?.WARN);
  for (const rate of ['heartbeats', 'renewals', 'expiries']) {
    setStat(`rates.${rate}`, view?.rates?.[rate], 2);
  }
  fillTable('#stages', latencyRows(view?.heartbeat_stage_ms));
  fillTable('#redis', latencyRows(view?.redis_ms));
  fillTable(
    '#close-codes',
    Object.entries(view?.close_codes ?? {}).map(([c, n]) => [c, number(n)]),
  );
  fillTable(
    '#expiries',
    Object.entries(view?.expiries_total ?? {}).map(([r, n]) => [r, number(n)]),
  );
  renderNodes(stats);
  renderHealth(healthOf);
  renderCharts();
}

function renderCluster(cluster) {
  setStat('cluster.ACTIVE', cluster.sessions?.ACTIVE);
  setStat('cluster.WARN', cluster.sessions?.WARN);
  for (const [how] of ENDED) setStat(`ended.${how}`, cluster.ended?.[how]);
  setStat('nodes', state.nodes.length);
  const stale = !cluster.fresh;
  for (const element of document.querySelectorAll('[data-stat^="cluster."], [data-stat^="ended."]')) {
    element.classList.toggle('stale', stale);
    element.title = stale
      ? `Redis unreachable: ${cluster.at ? `as read at ${clock(cluster.at)}` : 'never read'}`
      : '';
  }
}

function renderPicker(self) {
  const select = $('#node-select');
  const names = [...state.nodes.map((v) => v.node), ALL];
  if (state.shown !== ALL && !names.includes(state.shown)) names.unshift(state.shown);
  const wanted = names.join('\n');
  if (select.dataset.names !== wanted) {
    select.dataset.names = wanted;
    select.replaceChildren(
      ...names.map((name) => {
        const label = name === ALL ? 'all nodes' : name === self ? `${name} (this one)` : name;
        return new Option(label, name);
      }),
    );
  }
  select.value = state.shown;
  $('#node-picker').hidden = false;
}

function renderNodes(stats) {
  const body = fillTable(
    '#nodes',
    state.nodes.map((v) => [
      v.node,
      v.ready ? 'yes' : 'no',
      number(v.connections),
      number(v.held?.ACTIVE),
      number(v.held?.WARN),
      number(v.rates?.heartbeats, 1),
      v.redis?.reachable ? number(v.redis.latency_ms, 2) : 'unreachable',
      number(v.loop_lag_ms?.mean, 2),
      `${Math.max(0, Math.round((stats.at - v.at) / 1000))} s ago`,
    ]),
  );
  for (const tr of body.rows) {
    tr.classList.toggle('shown', tr.dataset.key === state.shown);
    tr.classList.toggle('down', tr.cells[1].textContent === 'no');
    tr.addEventListener('click', () => show(tr.dataset.key));
  }
}

function listed(counts) {
  return Object.entries(counts ?? {})
    .map(([key, n]) => `${key} ${number(n)}`)
    .join(', ');
}

/** The health checks of a node's view: [key, label, text, healthy]. */
function checks(v) {
  const problems = Object.entries(v.problems ?? {})
    .map(([part, why]) => `${part}: ${typeof why === 'string' ? why : JSON.stringify(why)}`)
    .join('; ');
  const store = v.store_stage ?? {};
  const files = v.open_files ?? {};
  const refused = v.refused ?? {};
  return [
    ['ready', 'ready', v.ready ? 'yes' : `no: ${problems}`, v.ready],
    [
      'redis',
      'Redis',
      v.redis?.reachable
        ? `reachable, PING ${number(v.redis.latency_ms, 3)} ms`
        : `unreachable: ${v.redis?.error ?? ''}`,
      v.redis?.reachable,
    ],
    [
      'shedding',
      'shedding',
      v.shedding?.active
        ? `yes: ${v.shedding.classes}${v.shedding.refusing_handshakes ? '; new handshakes refused (503)' : ''}`
        : 'no',
      !v.shedding?.active,
    ],
    [
      'lag',
      'event loop lag',
      `mean ${number(v.loop_lag_ms?.mean, 2)} ms, max ${number(v.loop_lag_ms?.max, 2)} ms (last second)`,
      true,
    ],
    ['refused-429', 'refused 429', listed(refused['429']), true],
    ['refused-503', 'refused 503', listed(refused['503']), true],
    ['refused-4029', 'closed 4029', listed(refused['4029']), true],
    [
      'files',
      'open files',
      `${number(files.open)} of ${files.limit ? number(files.limit) : 'no limit'}` +
        ` (handshakes refused beyond ${number(files.connection_cap)} connections)`,
      !files.limit || files.open < 0.9 * files.limit,
    ],
    [
      'store',
      'store stage p50',
      `${number(store.store_p50_ms, 3)} ms = heartbeat script ${number(store.script_p50_ms, 3)} ms` +
        ` + wait ${number(store.wait_p50_ms, 3)} ms (the gather waits up to ${number(store.gather_ms, 3)} ms)`,
      true,
    ],
  ];
}

function renderHealth(views) {
  $('#health thead tr').replaceChildren(
    ...['check', ...views.map((v) => v.node)].map((text) => {
      const th = document.createElement('th');
      th.textContent = text;
      return th;
    }),
  );
  const rows = views.length ? checks(views[0]).map(([key, label]) => [key, label]) : [];
  const body = $('#health tbody');
  body.replaceChildren(
    ...rows.map(([key, label]) => {
      const tr = document.createElement('tr');
      tr.dataset.check = key;
      tr.insertCell().textContent = label;
      for (const v of views) {
        const [, , text, healthy] = checks(v).find(([k]) => k === key);
        const td = tr.insertCell();
        td.textContent = text;
        td.dataset.node = v.node;
        td.classList.toggle('bad', !healthy);
      }
      return tr;
    }),
  );
}

// Charts: SVG, a time axis and a scale, one polyline per series.

function niceMax(value) {
  if (!(value > 0)) return 1;
  const magnitude = 10 ** Math.floor(Math.log10(value));
  for (const step of [1, 2, 2.5, 5, 10]) if (value <= step * magnitude) return step * magnitude;
  return 10 * magnitude;
}

function svgElement(name, attributes, text) {
  const element = document.createElementNS(SVG, name);
  for (const [key, value] of Object.entries(attributes)) element.setAttribute(key, value);
  if (text !== undefined) element.textContent = text;
  return element;
}

/** Draw `series` ({name, cls, value(sample) -> number | null}) over `samples`. */
function drawChart(id, samples, series) {
  const svg = $(`#${id}`);
  const section = svg.closest('section');
  const { width, height, left, right, top, bottom } = PLOT;
  svg.setAttribute('viewBox', `0 0 ${width} ${height}`);
  const parts = [];
  const intervalMs = state.interval * 1000;
  const values = samples.flatMap((s) => series.map((d) => d.value(s))).filter((v) => v != null);
  const max = niceMax(Math.max(0, ...values));
  const end = samples.at(-1)?.at ?? Date.now();
  const begin = Math.min(samples[0]?.at ?? end, end - intervalMs) - intervalMs;
  const x = (at) => left + ((at - begin) / (end - begin)) * (width - left - right);
  const y = (v) => height - bottom - (v / max) * (height - top - bottom);
  for (const fraction of [0, 0.5, 1]) {
    const at = y(max * fraction);
    parts.push(svgElement('line', { class: 'grid', x1: left, x2: width - right, y1: at, y2: at }));
    parts.push(
      svgElement(
        'text',
        { class: 'tick', x: left - 6, y: at + 4, 'text-anchor': 'end' },
        number(max * fraction, 2),
      ),
    );
  }
  for (let i = 0; i <= X_TICKS; i += 1) {
    const at = begin + ((end - begin) * i) / X_TICKS;
    const anchor = i === 0 ? 'start' : i === X_TICKS ? 'end' : 'middle';
    parts.push(
      svgElement(
        'text',
        { class: 'tick', x: x(at), y: height - 6, 'text-anchor': anchor },
        clock(at, end - begin < X_TICKS * 2000), // ticks under 2 s apart: tenths too
      ),
    );
  }
  for (const [n, { name, cls, value }] of series.entries()) {
    const points = samples
      .map((s) => [s.at, value(s)])
      .filter(([, v]) => v != null)
      .map(([at, v]) => `${x(at).toFixed(1)},${y(v).toFixed(1)}`);
    const line = svgElement('polyline', {
      class: `line ${cls ?? `s${n % 6}`}`,
      points: points.join(' '),
      'data-series': name,
      'data-count': points.length,
    });
    const last = samples.findLast((s) => value(s) != null);
    if (last) line.dataset.last = value(last);
    parts.push(line);
  }
  if (!samples.length) {
    parts.push(
      svgElement(
        'text',
        { class: 'tick', x: width / 2, y: height / 2, 'text-anchor': 'middle' },
        `no sample yet: one every ${state.interval} s`,
      ),
    );
  }
  svg.replaceChildren(...parts);
  svg.dataset.max = max;
  svg.dataset.samples = samples.length;
  const seconds = Math.round((end - begin) / 1000);
  $('.span', section).textContent =
    `(last ${seconds >= 120 ? `${Math.round(seconds / 60)} min` : `${seconds} s`}, ` +
    `one point per ${state.interval} s)`;
  $('.legend', section).replaceChildren(
    ...series.flatMap(({ name, cls }, n) => {
      const key = document.createElement('span');
      key.className = `key ${cls ?? `s${n % 6}`}`;
      return [key, document.createTextNode(`${name} `)];
    }),
  );
}

function renderCharts() {
  const samples = state.history;
  const perSecond = 1 / state.interval;
  drawChart('chart-states', samples, [
    { name: 'ACTIVE', cls: 'active', value: (s) => s.sessions?.ACTIVE ?? null },
    { name: 'WARN', cls: 'warn', value: (s) => s.sessions?.WARN ?? null },
  ]);
  drawChart(
    'chart-ended',
    samples,
    ENDED.map(([how, name], n) => ({
      name,
      cls: ['expired', 'revoked', 's2'][n],
      value: (s) => s.ended?.[how] ?? null,
    })),
  );
  drawChart('chart-rates', samples, [
    { name: 'heartbeats/s', value: (s) => s.heartbeats * perSecond },
    { name: 'renewals/s', value: (s) => s.renewals * perSecond },
    { name: 'expiries/s', value: (s) => s.expiries * perSecond },
  ]);
  const codes = [...new Set(samples.flatMap((s) => Object.keys(s.closes)))].sort();
  drawChart(
    'chart-closes',
    samples,
    codes.map((code) => ({ name: code, value: (s) => (s.closes[code] ?? 0) * perSecond })),
  );
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

$('#node-select').addEventListener('change', (event) => show(event.target.value));

readFragment();
const saved = sessionStorage.getItem(TOKEN_KEY);
if (saved) start(saved);
else showLogin();
