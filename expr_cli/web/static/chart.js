// The reducer chart over steps: the p05-p95 band, p50, mean and weighted mean (uPlot), with
// marks at the steps where the run stalled or a rank crashed (a line and its words), and a
// drag across it picks the step window (`onBrush(lo, hi)`, half-open).
import uPlot from "/static/vendor/uplot/uPlot.esm.js";

const COLORS = { band: "rgba(43,108,176,0.15)", edge: "rgba(43,108,176,0.35)", p50: "#2b6cb0",
                 mean: "#c05621", wmean: "#2f855a" };
const MARK = "#c53030";
let plot = null;

function size(el) { return { width: Math.max(320, el.clientWidth || 800), height: 300 }; }

// steps are integers: ticks at 1, 2, 5, 10, 20, 50, ... steps apart, never at 12.5
export const STEP_INCRS = Array.from({ length: 16 }, (_, e) => [1, 2, 5].map((m) => m * 10 ** e)).flat();

function nums(col) { return (col || []).map((v) => (typeof v === "number" ? v : null)); }

// the marks: a dashed red line at each step, its text at the top
function drawMarks(u) {
  const marks = u.__marks || [];
  if (!marks.length) return;
  const { ctx, bbox } = u;
  const [x0, x1] = [u.scales.x.min, u.scales.x.max];
  ctx.save();
  ctx.strokeStyle = MARK; ctx.fillStyle = MARK;
  ctx.lineWidth = 2 * devicePixelRatio;
  ctx.setLineDash([6 * devicePixelRatio, 4 * devicePixelRatio]);
  ctx.font = `${11 * devicePixelRatio}px system-ui, sans-serif`;
  ctx.textBaseline = "top";
  marks.filter((m) => m.step >= x0 && m.step <= x1).forEach((m, i) => {
    const x = u.valToPos(m.step, "x", true);
    ctx.beginPath(); ctx.moveTo(x, bbox.top); ctx.lineTo(x, bbox.top + bbox.height); ctx.stroke();
    const w = ctx.measureText(m.label).width;
    const tx = x + 4 * devicePixelRatio + w > bbox.left + bbox.width ? x - 4 * devicePixelRatio - w : x + 4 * devicePixelRatio;
    ctx.fillText(m.label, tx, bbox.top + (4 + 14 * i) * devicePixelRatio);
  });
  ctx.restore();
}

export function drawChart(el, chart, marks = [], onBrush = null) {
  const data = [chart.step, nums(chart.p05), nums(chart.p95), nums(chart.p50), nums(chart.mean), nums(chart.wmean)];
  el.__onBrush = onBrush;
  el.__marks = marks;
  if (plot && plot.__key === chart.key && plot.__el === el) { plot.__marks = marks; plot.setData(data); el.dataset.marks = String(marks.length); return; }
  if (plot) plot.destroy();
  el.replaceChildren();
  plot = new uPlot({
    ...size(el),
    scales: { x: { time: false } },
    axes: [{ label: "step", incrs: STEP_INCRS }, { label: chart.key }],
    cursor: { drag: { x: true, y: false, setScale: false } },
    series: [
      { label: "step" },
      { label: "p05", stroke: COLORS.edge, width: 1 },
      { label: "p95", stroke: COLORS.edge, width: 1 },
      { label: "p50", stroke: COLORS.p50, width: 2 },
      { label: "mean", stroke: COLORS.mean, width: 1.5, dash: [6, 3] },
      { label: "wmean", stroke: COLORS.wmean, width: 1.5 },
    ],
    bands: [{ series: [2, 1], fill: COLORS.band }],
    hooks: {
      draw: [drawMarks],
      setSelect: [(u) => {
        if (u.select.width < 4 || !el.__onBrush) return;
        const lo = Math.ceil(u.posToVal(u.select.left, "x"));
        const hi = Math.floor(u.posToVal(u.select.left + u.select.width, "x")) + 1;
        u.setSelect({ left: 0, top: 0, width: 0, height: 0 }, false);
        if (hi > lo) el.__onBrush(lo, hi);
      }],
    },
  }, data, el);
  plot.__key = chart.key;
  plot.__el = el;
  plot.__marks = marks;
  el.__plot = plot; // for a test to read what it drew
  el.dataset.marks = String(marks.length);
}

export function resizeChart(el) { if (plot) plot.setSize(size(el)); }
