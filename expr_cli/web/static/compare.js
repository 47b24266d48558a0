// The compare page: one metric of several runs, aligned by step (median across ranks); a
// log scale (`?log=1`) for a metric whose first steps dwarf the rest, and smoothing
// (`?smooth=N`: the mean of each run's last N values), kept in the URL.
import uPlot from "/static/vendor/uplot/uPlot.esm.js";
import { ApiError, get } from "./api.js";
import { STEP_INCRS } from "./chart.js";
import { h, replace } from "./dom.js";

const PALETTE = ["#2b6cb0", "#c05621", "#2f855a", "#6b46c1", "#b83280", "#2c7a7b", "#975a16", "#4a5568"];
const SMOOTH = [1, 5, 10, 25, 50, 100];
const q = new URLSearchParams(window.location.search);
const runs = q.getAll("run"), metric = q.get("metric") || "";
const view = { log: q.get("log") === "1", smooth: Math.max(1, Number(q.get("smooth")) || 1) };
let plot = null, data = null;

// a trailing mean of the last `n` values (nulls skipped, kept where they were)
export function smooth(values, n) {
  if (n <= 1) return values;
  const out = [], win = [];
  let sum = 0;
  for (const v of values) {
    if (v === null) { out.push(null); continue; }
    win.push(v); sum += v;
    if (win.length > n) sum -= win.shift();
    out.push(sum / win.length);
  }
  return out;
}

function keepInUrl() {
  const p = new URLSearchParams(window.location.search);
  p.delete("log"); p.delete("smooth");
  if (view.log) p.set("log", "1");
  if (view.smooth > 1) p.set("smooth", String(view.smooth));
  history.replaceState(null, "", `${window.location.pathname}?${p}`);
}

function draw() {
  const el = document.getElementById("chart");
  const ys = data.runs.map((r) => {
    const vals = smooth(r.values.map((v) => (typeof v === "number" && Number.isFinite(v) ? v : null)), view.smooth);
    return view.log ? vals.map((v) => (v !== null && v > 0 ? v : null)) : vals;
  });
  const series = [{ label: "step" }, ...data.runs.map((r, i) => ({ label: r.run, stroke: PALETTE[i % PALETTE.length], width: 2, spanGaps: true }))];
  if (plot) plot.destroy();
  el.replaceChildren();
  plot = new uPlot({ width: Math.max(320, el.clientWidth || 900), height: 340,
    scales: { x: { time: false }, y: view.log ? { distr: 3 } : {} },
    axes: [{ label: "step", incrs: STEP_INCRS }, { label: `${data.metric}${view.log ? " (log)" : ""}${view.smooth > 1 ? `, mean of ${view.smooth}` : ""}` }],
    series }, [data.steps, ...ys], el);
  el.__plot = plot;
  el.dataset.log = view.log ? "1" : "0";
  el.dataset.smooth = String(view.smooth);
}

function controls() {
  const log = h("input", { type: "checkbox", id: "compare-log", checked: view.log });
  log.onchange = () => { view.log = log.checked; keepInUrl(); draw(); };
  const sm = h("select", { id: "compare-smooth" }, [...new Set([...SMOOTH, view.smooth])].sort((a, b) => a - b)
    .map((n) => h("option", { value: n, selected: n === view.smooth }, n === 1 ? "none" : `mean of ${n} steps`)));
  sm.onchange = () => { view.smooth = Number(sm.value); keepInUrl(); draw(); };
  replace(document.getElementById("compare-controls"), h("label", {}, log, " log scale"), " ",
    h("label", {}, "smoothing ", sm));
}

async function main() {
  document.getElementById("compare-title").textContent = runs.join(" · ");
  try {
    data = await get("/api/compare", { run: runs, metric });
    document.getElementById("compare-metric").textContent = data.metric;
    controls();
    draw();
    replace(document.getElementById("compare-runs"), h("ul", { class: "list", id: "compare-list" }, data.runs.map((r, i) =>
      h("li", {}, h("span", { class: "mono" }, "■ ").valueOf(), h("a", { href: `/runs/${r.run.split("/").map(encodeURIComponent).join("/")}` }, r.run),
        h("span", { class: "muted" }, ` ${r.ranks} ranks, ${r.values.filter((v) => v !== null).length} steps`)))));
    document.querySelectorAll("#compare-list li .mono").forEach((el2, i) => { el2.style.color = PALETTE[i % PALETTE.length]; });
    document.body.dataset.loaded = "1";
  } catch (err) {
    const el = document.getElementById("missing");
    el.hidden = false;
    el.textContent = err instanceof ApiError ? `${err.message}.` : `error: ${err.message}`;
  }
}

main();
