// The run page: fetches the summary (all keys and the picked one, its chart and the noisier
// ranks over the chart's steps), the heatmap and top for the user's step window (the URL's:
// window.js), and hands each to its panel; the event stream triggers a refetch, never a
// reload. Until the first answers are in, the page says what it is reading.
import { ApiError, answerOf, get, runPath } from "./api.js";
import { drawChart, resizeChart } from "./chart.js";
import { drawCoverage } from "./coverage.js";
import { h, ranksText, replace } from "./dom.js";
import { drawFound, foundMarks } from "./found.js";
import { drawHeader, drawLive } from "./header.js";
import { drawHeatmap, drawLegend, drawRowList, heatRows, parseRanks, rankRows, rowAt } from "./heatmap.js";
import { drawIncidents } from "./incidents.js";
import { follow } from "./live.js";
import { drawNoisier, noisierByRank } from "./noisier.js";
import { drawOutliers } from "./outliers.js";
import { drawPicker, metricGroups, metricKeys } from "./picker.js";
import { drawRanks } from "./ranks.js";
import { drawTiles } from "./tiles.js";
import { DEFAULT_LAST, apiSteps, describe, drawWindow, readWindow, setWindow } from "./window.js";

const $ = (id) => document.getElementById(id);
const parts = window.location.pathname.split("/").filter(Boolean).map(decodeURIComponent);
const [project, name] = [parts[1], parts[2]];
const label = `${project}/${name}`;
const base = runPath(project, name);
const page = { metric: new URLSearchParams(window.location.search).get("metric"), busy: false, again: false,
               drill: null, loaded: false, noisier: new Map(), win: readWindow(), frontier: null,
               started: performance.now() };

const RETRY_MS = 2000; // a run not there yet (the job is starting): look again this often
const TOP_POLL_MS = 1000; // top still reading its detectors' window: ask again this often
// what moves with no file changing (no change event): each rank's silence, a silent rank's
// steps/s, and the incidents of time (hang, stall); top again this often
const TOP_REFRESH_MS = 5000;
const LOADING_MS = 200;

function missing(message) {
  $("content").hidden = true;
  $("loading").hidden = true;
  const el = $("missing");
  el.hidden = false;
  el.textContent = message;
  drawHeader(label, null, null);
  drawLive(`checking again every ${RETRY_MS / 1000} s`);
}

// the first visit of a big run: what is being read (shards scanned of those listed), and
// for how long so far, until the first answers are drawn
const PROGRESS_MS = 500;

function showReading() {
  const tick = () => {
    if (page.loaded || $("loading").hidden) return;
    const p = page.progress;
    const secs = ((performance.now() - page.started) / 1000).toFixed(1);
    const n = (x) => x.toLocaleString("en-US");
    let what = "listing its shards";
    if (p && p.shards_total) {
      what = p.shards_read >= p.shards_total ? `${n(p.shards_total)} of ${n(p.shards_total)} shards read; reducing`
        : `${n(p.shards_read)} of ${n(p.shards_total)} shards read${p.world_size ? "" : " (and their sidecars)"}`;
    }
    $("loading").textContent = `reading ${label}: ${what}, ${describe(page.win)} ... ${secs} s`;
    setTimeout(tick, LOADING_MS);
  };
  const poll = () => {
    if (page.loaded) return;
    get(`${base}/progress`).then((p) => { page.progress = p; }).catch(() => {})
      .finally(() => { if (!page.loaded) setTimeout(poll, PROGRESS_MS); });
  };
  tick();
  poll();
}

function pick(k) {
  page.metric = k; page.drill = null; page.noisier = new Map();
  const q = new URLSearchParams(window.location.search); q.set("metric", k);
  history.replaceState(null, "", `${window.location.pathname}?${q}`);
  load();
}

function setWin(win) {
  page.win = win; page.drill = null; page.noisier = new Map();
  setWindow(win);
  load();
}

// every key's outliers: those of the summary of all keys, and of the picked key when apart
function outliersOf(all, one) {
  const keys = [...(all.keys || [])];
  for (const k of one.keys || []) if (!keys.some((x) => x.key === k.key)) keys.push(k);
  return { ...all, keys };
}

function chartMarks(one, top, hm) {
  const marks = foundMarks(one);
  if (top && !top.reading && top.job && top.job.state === "stalled" && top.frontier !== null) {
    marks.push({ step: top.frontier, label: `stalled at step ${top.frontier}` });
  }
  // a lost node (its ranks and exprd silent), or ranks silent while the others went on
  // (hang), at the step they stopped
  for (const inc of (top && !top.reading && top.incidents) || []) {
    if ((inc.kind === "hang" || inc.kind === "lost") && typeof inc.step === "number") {
      const on = inc.kind === "lost" && inc.hosts && inc.hosts.length ? `${inc.hosts.join(", ")}, ` : "";
      marks.push({ step: inc.step, label: `lost: ${on}rank${inc.ranks.length > 1 ? "s" : ""} ${ranksText(inc.ranks)}` });
    }
  }
  const root = hm && hm.heatmap_page ? (hm.heatmap_page.marked || []).find((m) => m.root) : null;
  if (root && root.step !== null) marks.push({ step: root.step, label: `rank ${root.ranks} crashed` });
  return marks;
}

// the first visit: the tiles at the frontier step from the state the server reads first
// (`first=1`), drawn while it reads the window of every tail that the rest of the summary
// needs (seconds at 16,384 ranks); the whole summary draws them again. Null once drawn;
// else the whole summary (the server had it, or the first answer could not be exact).
async function drawFirst() {
  const early = window.firstSummary; // (sent by first.js before this module was loaded)
  window.firstSummary = null;
  let first = null;
  try { if (early) first = await answerOf(await early); } catch (err) { if (err instanceof ApiError) throw err; }
  first = first || await get(`${base}/summary`, { chart: page.metric, first: 1 });
  if (!first.first) return first;
  $("missing").hidden = true;
  $("content").hidden = false;
  drawHeader(label, first, null);
  // (not another key's tiles for a picked key the first answer has not: a step rows' key)
  if (first.keys && (!page.metric || first.keys.some((k) => k.key === page.metric))) {
    drawTiles($("tiles"), first, page.metric);
    document.body.dataset.first = "1";
  }
  // painted before the whole summary is asked: on two cores its read takes both
  await new Promise((done) => requestAnimationFrame(() => setTimeout(done, 0)));
  return null;
}

async function load() {
  if (page.busy) { page.again = true; return; }
  page.busy = true;
  try {
    let steps = apiSteps(page.win, page.frontier);
    const firstVisit = !page.loaded && steps === null && page.win.kind === "last" && page.win.n === DEFAULT_LAST;
    // one summary answers the tiles, the outliers, the coverage and the chart (chart=KEY)
    let all = (firstVisit && await drawFirst()) || await get(`${base}/summary`, { chart: page.metric, steps });
    if (page.win.kind === "last" && page.win.n !== DEFAULT_LAST && steps === null && typeof all.step === "number") {
      page.frontier = all.step; // the last N steps: of the frontier the default answer found
      steps = apiSteps(page.win, page.frontier);
      all = await get(`${base}/summary`, { chart: page.metric, steps });
    }
    page.frontier = all.step ?? (all.ranks || {}).frontier ?? page.frontier;
    const keys = metricKeys(all);
    if (!page.metric || !keys.includes(page.metric)) {
      const g = metricGroups(all);
      page.metric = g.records[0] || g.stepRows[0] || null;
    }
    drawPicker($("metric"), all, page.metric, pick);
    drawWindow($("window"), page.win, setWin);
    const m = page.metric;
    const inAll = (all.keys || []).some((k) => k.key === m) && all.chart && all.chart.key === m;
    // the heatmap and top are asked now, and drawn when they come: the summary's panels
    // (tiles, chart, outliers, coverage) do not wait for them
    const hmAsk = m ? get(`${base}/heatmap`, { metric: m, buckets: 60, steps }).catch((e) => ({ error: e.message })) : Promise.resolve(null);
    // (its failure kept until awaited: not an unhandled rejection meanwhile)
    const topAsk = get(`${base}/top`, { limit: 64 }).then((v) => ({ v }), (e) => ({ e }));
    const one = inAll || !m ? all : await get(`${base}/summary`, { metric: m, chart: m, steps });
    $("missing").hidden = true;
    $("loading").hidden = true;
    $("content").hidden = false;
    page.summary = all;
    drawHeader(label, all, page.top || null);
    if (one.keys) {
      drawTiles($("tiles"), one, m);
      drawCoverage($("coverage"), $("coverage-note"), one);
    } else {
      $("tiles").textContent = "this run has no rank records; pick a metric its ranks log";
    }
    drawOutliers($("outliers"), outliersOf(all, one));
    const chart = (top, hm) => {
      if (!one.keys || !one.chart) return;
      drawChart($("chart"), one.chart, chartMarks(all, top, hm), (lo, hi) => setWin({ kind: "range", lo, hi }));
      const n = one.chart.step.length;
      $("chart-note").textContent = `${one.chart.key}, ${page.win.kind === "last" ? `last ${n} steps` : `${describe(page.win)} (${n} steps)`}; drag across it to pick steps`;
    };
    chart(page.top, page.hm);
    document.body.dataset.tiles = "1";
    const [hm, topGot] = await Promise.all([hmAsk, topAsk]);
    if (topGot.e) throw topGot.e;
    const top = topGot.v;
    page.top = top;
    drawHeader(label, all, top);
    drawTop(top);
    drawFound($("found"), all, top);
    if (hm && hm.heatmap) {
      page.hm = hm;
      const hmap = hm.heatmap;
      const rows = heatRows(hmap, hm.heatmap_page);
      page.scale = (hm.heatmap_page && hm.heatmap_page.scale) || null;
      drawHeatmap($("heatmap"), rows, hmap.buckets, page.scale, chartMarks(all, top, hm));
      drawRowList($("heatmap-rows"), rows);
      drawLegend($("heatmap-legend"), $("heatmap").__scale);
      const big = rows.length < hm.world_size;
      $("heatmap-note").textContent = `${hmap.key} (${hmap.agg}), ${rows.length} rows for ${hm.world_size.toLocaleString("en-US")} ranks`
        + (big ? ": outlier ranks, the worst nodes, then the rest binned; click a node or a bin" : "");
      if (page.drill) drill(page.drill);
    } else if (hm && hm.error) {
      $("heatmap-note").textContent = hm.error;
    }
    chart(top, hm);
    // the oldest version drawn: the event stream stays quiet until the run moves past it
    const drawn = [all, one, hm, top].map((a) => a && a.version).filter(Boolean);
    page.version = drawn.sort((a, b) => Number(a.split(".")[1]) - Number(b.split(".")[1]))[0] || null;
    page.loaded = true;
    document.body.dataset.loaded = "1";
    document.body.dataset.window = page.win.kind;
    // is a rank noisier over the chart's steps? The summary carries it with its chart
    // (`chart.variability`, as `expr summary -m KEY --steps A:B --json` gives it)
    if (one.keys && one.chart && one.chart.key === m && one.chart.variability && one.chart.step.length >= 2) {
      const st = one.chart.step;
      const win = { steps: [st[0], st[st.length - 1] + 1], keys: [{ key: m, variability: one.chart.variability }] };
      page.noisier = noisierByRank(win);
      drawNoisier($("noisier"), win);
      if (!top.reading) drawRanks($("ranks"), top, page.noisier);
      document.body.dataset.noisier = "1";
    }
  } catch (err) {
    if (err instanceof ApiError && err.status === 404) {
      missing(`${err.message}.`);
      if (!page.loaded) setTimeout(start, RETRY_MS);
    } else drawLive(`error: ${err.message}`);
  } finally {
    page.busy = false;
    if (page.again) { page.again = false; load(); }
  }
}

// top's panels; while the server reads the window its detectors need (a run of thousands
// of ranks, just opened) they say so, and the page asks again: no "no open incidents" yet
function drawTop(top) {
  if (top.reading) {
    const note = (id) => h("p", { class: "muted", id }, `${top.job.text}...`);
    replace($("incidents"), note("incidents-reading"));
    replace($("ranks"), note("ranks-reading"));
    document.body.dataset.top = "reading";
    clearTimeout(page.topPoll);
    page.topPoll = setTimeout(pollTop, TOP_POLL_MS);
    return;
  }
  drawIncidents($("incidents"), top);
  drawRanks($("ranks"), top, page.noisier);
  document.body.dataset.top = "1";
}

// top again, alone (the summary and the heatmap drawn are still this version's)
async function pollTop() {
  if (page.busy) { page.topPoll = setTimeout(pollTop, TOP_POLL_MS); return; }
  try {
    const top = await get(`${base}/top`, { limit: 64 });
    drawTop(top);
    if (!top.reading) {
      drawHeader(label, page.summary, top);
      drawFound($("found"), page.summary, top);
    }
  } catch (err) {
    drawLive(`error: ${err.message}`);
  }
}

// a node's ranks, or a bin's nodes (a small run: the bin's ranks), in the page's colours
async function drill(row) {
  page.drill = row;
  const hmap = page.hm.heatmap;
  const bad = new Map((page.hm.heatmap_page ? page.hm.heatmap_page.marked : []).map((m) => [Number(m.ranks), m.state]));
  $("drill").hidden = false;
  try {
    let rows;
    if (row.kind === "bin" && hmap.nodes) {
      const inBin = new Set(parseRanks(row.ranks));
      rows = hmap.nodes.filter((n) => inBin.has(n.first))
        .map((n) => ({ label: n.node, kind: "node", ranks: n.ranks, cells: n.cells }));
      $("drill-title").textContent = `${row.label}: ${rows.length} nodes; click a node for its ranks`;
    } else if (hmap.nodes) {
      const hm = await get(`${base}/heatmap`, { metric: page.metric, buckets: 60, node: row.label, steps: apiSteps(page.win, page.frontier) });
      rows = rankRows(hm.heatmap.cells, bad);
      $("drill-title").textContent = `node ${row.label}: ${rows.length} ranks`;
    } else {
      const mine = new Set(parseRanks(row.ranks));
      rows = rankRows(Object.fromEntries(Object.entries(hmap.cells).filter(([r]) => mine.has(Number(r)))), bad);
      $("drill-title").textContent = `${row.kind === "bin" ? "" : "node "}${row.label}: ${rows.length} ranks`;
    }
    drawHeatmap($("drill-canvas"), rows, hmap.buckets, page.scale);
    document.body.dataset.drill = row.label;
  } catch (err) {
    $("drill-title").textContent = `${row.label}: ${err.message}`;
  }
}

for (const id of ["heatmap", "drill-canvas"]) {
  $(id).addEventListener("click", (ev) => {
    const row = rowAt($(id), ev);
    if (row && (row.kind === "node" || row.kind === "bin")) drill(row);
  });
}
$("drill-close").addEventListener("click", () => { page.drill = null; $("drill").hidden = true; });
window.addEventListener("resize", () => resizeChart($("chart")));

// the first load, again every RETRY_MS while the run is not there; then the event stream
function start() {
  load().then(() => {
    if (!page.loaded || page.following) return;
    page.following = true;
    follow(page.version ? `${base}/events?version=${encodeURIComponent(page.version)}` : `${base}/events`,
      () => load(), (s) => drawLive(s));
    setInterval(() => { if (!page.busy) pollTop(); }, TOP_REFRESH_MS);
  });
}

drawHeader(label, null, null);
showReading();
start();
