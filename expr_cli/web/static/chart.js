// The reducer chart over steps: the p05-p95 band, p50, mean and weighted mean (uPlot).
import uPlot from "/static/vendor/uplot/uPlot.esm.js";

const COLORS = { band: "rgba(43,108,176,0.15)", edge: "rgba(43,108,176,0.35)", p50: "#2b6cb0",
                 mean: "#c05621", wmean: "#2f855a" };
let plot = null;

function size(el) { return { width: Math.max(320, el.clientWidth || 800), height: 300 }; }

// steps are integers: ticks at 1, 2, 5, 10, 20, 50, ... steps apart, never at 12.5
export const STEP_INCRS = Array.from({ length: 16 }, (_, e) => [1, 2, 5].map((m) => m * 10 ** e)).flat();

function nums(col) { return (col || []).map((v) => (typeof v === "number" ? v : null)); }

export function drawChart(el, chart) {
  const data = [chart.step, nums(chart.p05), nums(chart.p95), nums(chart.p50), nums(chart.mean), nums(chart.wmean)];
  if (plot && plot.__key === chart.key) { plot.setData(data); return; }
  if (plot) plot.destroy();
  el.replaceChildren();
  plot = new uPlot({
    ...size(el),
    scales: { x: { time: false } },
    axes: [{ label: "step", incrs: STEP_INCRS }, { label: chart.key }],
    series: [
      { label: "step" },
      { label: "p05", stroke: COLORS.edge, width: 1 },
      { label: "p95", stroke: COLORS.edge, width: 1 },
      { label: "p50", stroke: COLORS.p50, width: 2 },
      { label: "mean", stroke: COLORS.mean, width: 1.5, dash: [6, 3] },
      { label: "wmean", stroke: COLORS.wmean, width: 1.5 },
    ],
    bands: [{ series: [2, 1], fill: COLORS.band }],
  }, data, el);
  plot.__key = chart.key;
  el.__plot = plot; // for a test to read what it drew
}

export function resizeChart(el) { if (plot) plot.setSize(size(el)); }
