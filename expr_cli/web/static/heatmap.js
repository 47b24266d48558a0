// The heatmap on a canvas: one row per rank, or per node past PAGE_RANKS ranks (the API
// sends `nodes` then); a click on a node row drills into its ranks. Viridis, as the CLI.
import { num } from "./dom.js";

const VIRIDIS = ["#440154", "#472d7b", "#3b528b", "#2c728e", "#21918c", "#28ae80", "#5ec962", "#addc30", "#fde725"];
const MISSING = "#e6e6e6";
const LABEL_W = 96;

function rgb(hex) { return [1, 3, 5].map((i) => parseInt(hex.slice(i, i + 2), 16)); }
const STOPS = VIRIDIS.map(rgb);

function color(t) {
  const x = Math.min(1, Math.max(0, t)) * (STOPS.length - 1);
  const i = Math.min(STOPS.length - 2, Math.floor(x)), f = x - i;
  const c = STOPS[i].map((v, k) => Math.round(v + (STOPS[i + 1][k] - v) * f));
  return `rgb(${c[0]},${c[1]},${c[2]})`;
}

export function heatRows(hm) {
  if (hm.nodes) return hm.nodes.map((n) => ({ label: n.node, node: n.node, cells: n.cells, ranks: n.ranks }));
  return Object.keys(hm.cells || {}).map(Number).sort((a, b) => a - b)
    .map((r) => ({ label: `rank ${r}`, rank: r, cells: hm.cells[String(r)] }));
}

export function drawHeatmap(canvas, rows, buckets, legend) {
  const finite = [];
  for (const row of rows) for (const v of row.cells || []) if (typeof v === "number" && Number.isFinite(v)) finite.push(v);
  const lo = finite.length ? Math.min(...finite) : 0, hi = finite.length ? Math.max(...finite) : 1;
  const cols = Math.max(1, (buckets || []).length || ((rows[0] && rows[0].cells.length) || 1));
  const rh = rows.length ? Math.max(1, Math.min(16, Math.floor(520 / rows.length))) : 16;
  const dpr = window.devicePixelRatio || 1;
  const cssW = Math.max(320, canvas.clientWidth || 960);
  const cssH = Math.max(24, rows.length * rh + 18);
  canvas.width = Math.round(cssW * dpr);
  canvas.height = Math.round(cssH * dpr);
  canvas.style.height = `${cssH}px`;
  const ctx = canvas.getContext("2d");
  ctx.setTransform(dpr, 0, 0, dpr, 0, 0);
  ctx.fillStyle = "#fff";
  ctx.fillRect(0, 0, cssW, cssH);
  const labels = rh >= 9;
  const x0 = labels ? LABEL_W : 0;
  const cw = (cssW - x0) / cols;
  ctx.font = "11px system-ui, sans-serif";
  ctx.textBaseline = "middle";
  rows.forEach((row, i) => {
    const y = i * rh;
    (row.cells || []).forEach((v, j) => {
      ctx.fillStyle = typeof v === "number" && Number.isFinite(v) ? color(hi > lo ? (v - lo) / (hi - lo) : 0.5) : MISSING;
      ctx.fillRect(x0 + j * cw, y, Math.ceil(cw), rh - (rh > 4 ? 1 : 0));
    });
    if (labels) { ctx.fillStyle = "#333"; ctx.fillText(row.label, 4, y + rh / 2); }
  });
  if (buckets && buckets.length) {
    ctx.fillStyle = "#666";
    const first = buckets[0], last = buckets[buckets.length - 1];
    ctx.fillText(`step ${first[0]}`, x0, rows.length * rh + 9);
    const end = `step ${last[last.length - 1]}`;
    ctx.fillText(end, cssW - ctx.measureText(end).width - 2, rows.length * rh + 9);
  }
  canvas.__rows = rows;
  canvas.__rh = rh;
  if (legend) legend.textContent = finite.length ? `${num(lo)} (dark) – ${num(hi)} (light); grey: no value` : "no values";
}

export function rowAt(canvas, ev) {
  const rect = canvas.getBoundingClientRect();
  const i = Math.floor((ev.clientY - rect.top) / (canvas.__rh || 1));
  return (canvas.__rows || [])[i] || null;
}
