// The run page: fetches the summary (all keys and the picked one, its chart and the noisier
// ranks over the chart's steps), the heatmap and top, and hands each to its panel; the
// event stream triggers a refetch, never a reload.
import { ApiError, get, runPath } from "./api.js";
import { drawChart, resizeChart } from "./chart.js";
import { drawCoverage } from "./coverage.js";
import { h, replace } from "./dom.js";
import { drawHeader, drawLive } from "./header.js";
import { drawHeatmap, heatRows, rowAt } from "./heatmap.js";
import { drawIncidents } from "./incidents.js";
import { follow } from "./live.js";
import { drawNoisier, noisierByRank } from "./noisier.js";
import { drawOutliers } from "./outliers.js";
import { drawPicker, metricKeys } from "./picker.js";
import { drawRanks } from "./ranks.js";
import { drawTiles } from "./tiles.js";

const $ = (id) => document.getElementById(id);
const parts = window.location.pathname.split("/").filter(Boolean).map(decodeURIComponent);
const [project, name] = [parts[1], parts[2]];
const label = `${project}/${name}`;
const base = runPath(project, name);
const page = { metric: new URLSearchParams(window.location.search).get("metric"), busy: false, again: false,
               drill: null, loaded: false, noisier: new Map() };

const RETRY_MS = 2000; // a run not there yet (the job is starting): look again this often
const TOP_POLL_MS = 1000; // top still reading its detectors' window: ask again this often
// what moves with no file changing (no change event): each rank's silence, a silent rank's
// steps/s, and the incidents of time (hang, stall); top again this often
const TOP_REFRESH_MS = 5000;

function missing(message) {
  $("content").hidden = true;
  const el = $("missing");
  el.hidden = false;
  el.textContent = message;
  drawHeader(label, null, null);
  drawLive(`checking again every ${RETRY_MS / 1000} s`);
}

async function load() {
  if (page.busy) { page.again = true; return; }
  page.busy = true;
  try {
    // one summary answers the tiles, the outliers, the coverage and the chart (chart=KEY)
    let all = await get(`${base}/summary`, { chart: page.metric });
    const keys = metricKeys(all);
    if (!page.metric || !keys.includes(page.metric)) page.metric = keys[0] || null;
    if (all.keys && all.chart && page.metric && all.chart.key !== page.metric) {
      all = await get(`${base}/summary`, { chart: page.metric });
    }
    drawPicker($("metric"), keys, page.metric, (k) => {
      page.metric = k; page.drill = null; page.noisier = new Map();
      const q = new URLSearchParams(window.location.search); q.set("metric", k);
      history.replaceState(null, "", `${window.location.pathname}?${q}`);
      load();
    });
    const m = page.metric;
    const [one, hm, top] = await Promise.all([
      // a run without rank records: the picked key of its step rows
      all.keys || !m ? Promise.resolve(all) : get(`${base}/summary`, { metric: m, chart: m }),
      m ? get(`${base}/heatmap`, { metric: m, buckets: 60 }).catch((e) => ({ error: e.message })) : Promise.resolve(null),
      get(`${base}/top`, { limit: 64 }),
    ]);
    $("missing").hidden = true;
    $("content").hidden = false;
    drawHeader(label, one, top);
    page.summary = one;
    if (one.keys) {
      drawTiles($("tiles"), one, m);
      if (one.chart) { drawChart($("chart"), one.chart); $("chart-note").textContent = `${one.chart.key}, last ${one.chart.step.length} steps`; }
      drawCoverage($("coverage"), $("coverage-note"), one);
    } else {
      $("tiles").textContent = "this run has no rank records; pick a metric its ranks log";
    }
    drawOutliers($("outliers"), all.keys ? all : one);
    drawTop(top);
    if (hm && hm.heatmap) {
      const h = hm.heatmap;
      drawHeatmap($("heatmap"), heatRows(h), h.buckets, $("heatmap-legend"));
      $("heatmap-note").textContent = `${h.key}, ${h.nodes ? `${h.nodes.length} nodes (${h.agg}); click a node for its ranks` : `${hm.world_size} ranks`}`;
      if (page.drill) drill(page.drill);
    } else if (hm && hm.error) {
      $("heatmap-note").textContent = hm.error;
    }
    // the oldest version drawn: the event stream stays quiet until the run moves past it
    const drawn = [all, one, hm, top].map((a) => a && a.version).filter(Boolean);
    page.version = drawn.sort((a, b) => Number(a.split(".")[1]) - Number(b.split(".")[1]))[0] || null;
    page.loaded = true;
    document.body.dataset.loaded = "1";
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
    if (!top.reading) drawHeader(label, page.summary, top);
  } catch (err) {
    drawLive(`error: ${err.message}`);
  }
}

async function drill(node) {
  page.drill = node;
  try {
    const hm = await get(`${base}/heatmap`, { metric: page.metric, buckets: 60, node });
    $("drill").hidden = false;
    $("drill-title").textContent = `node ${node}: ${Object.keys(hm.heatmap.cells).length} ranks`;
    drawHeatmap($("drill-canvas"), heatRows({ cells: hm.heatmap.cells }), hm.heatmap.buckets, null);
  } catch (err) {
    $("drill-title").textContent = `node ${node}: ${err.message}`;
  }
}

$("heatmap").addEventListener("click", (ev) => {
  const row = rowAt($("heatmap"), ev);
  if (row && row.node) drill(row.node);
});
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
start();
