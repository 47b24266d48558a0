// The heatmap on a canvas, built as the CLI's (DESIGN 14): the rows the API sends
// (`heatmap.rows`: every rank of a small run; past that the named outlier ranks, the worst
// nodes, then the other nodes binned), after them a row of its own for each crashed rank
// and each rank with no shard (`heatmap_page.marked`), every row labelled and tall enough
// to click. One colour scale (`heatmap_page.scale`, every rank's cells) for the page and
// every drill-down, so a healthy node is as dark in its drill-down as on the page.
// Crashed and missing are not colours of the scale: a red hatch, and a red label.
import { h, num, replace } from "./dom.js";

const VIRIDIS = ["#440154", "#472d7b", "#3b528b", "#2c728e", "#21918c", "#28ae80", "#5ec962", "#addc30", "#fde725"];
const NO_VALUE = "#e6e6e6";
const CRASHED = "#c53030";
const NON_FINITE = "#d53f8c"; // NaN or an infinity (the API spells them as text)
const LABEL_W = 180;
const ROW_H = 16; // px: a label is readable and a row is clickable
const AXIS_H = 18;

function rgb(hex) { return [1, 3, 5].map((i) => parseInt(hex.slice(i, i + 2), 16)); }
const STOPS = VIRIDIS.map(rgb);

export function color(t) {
  const x = Math.min(1, Math.max(0, t)) * (STOPS.length - 1);
  const i = Math.min(STOPS.length - 2, Math.floor(x)), f = x - i;
  const c = STOPS[i].map((v, k) => Math.round(v + (STOPS[i + 1][k] - v) * f));
  return `rgb(${c[0]},${c[1]},${c[2]})`;
}

// "0-7,16" -> [0..7, 16]
export function parseRanks(text) {
  const out = [];
  for (const part of String(text || "").split(",")) {
    const [a, b] = part.split("-").map(Number);
    if (!Number.isFinite(a)) continue;
    for (let r = a; r <= (Number.isFinite(b) ? b : a); r++) out.push(r);
  }
  return out;
}

const KIND = { rank: "rank", node: "node", bin: "nodes" };

// the page's rows: the marked ranks (crashed first, the root leading) then the API's rows,
// a rank already marked not repeated; each row knows the marked ranks it holds
export function heatRows(hm, page) {
  const marked = (page && page.marked) || [];
  const bad = new Map(marked.map((m) => [Number(m.ranks), m.state]));
  const rows = marked.map((m) => ({ ...m, label: m.label, note: m.root ? `${m.state}, failed first` : m.state,
    bad: m.state }));
  const named = new Set(marked.map((m) => m.ranks));
  for (const row of hm.rows || []) {
    if (row.kind === "rank" && named.has(row.ranks)) continue;
    const holds = row.kind === "rank" ? [Number(row.ranks)] : parseRanks(row.ranks);
    const hit = holds.filter((r) => bad.has(r));
    rows.push({ ...row, bad: hit.length ? bad.get(hit[0]) : null,
      note: hit.length ? `holds ${bad.get(hit[0])} rank ${hit.slice(0, 3).join(",")}` : null });
  }
  return rows;
}

// a drill-down's rows: the ranks of `cells` ({rank: cells}), or nodes ({node, ranks, cells})
export function rankRows(cells, bad = new Map()) {
  return Object.keys(cells || {}).map(Number).sort((a, b) => a - b)
    .map((r) => ({ label: `r${r}`, kind: "rank", ranks: String(r), cells: cells[String(r)],
      bad: bad.get(r) || null, note: bad.get(r) || null }));
}

export function scaleOf(rows) {
  let lo = Infinity, hi = -Infinity;
  for (const row of rows) for (const v of row.cells || []) {
    if (typeof v === "number" && Number.isFinite(v)) { lo = Math.min(lo, v); hi = Math.max(hi, v); }
  }
  return lo <= hi ? [lo, hi] : null;
}

function hatch(ctx, x, y, w, hgt) {
  ctx.fillStyle = "#fff5f5";
  ctx.fillRect(x, y, w, hgt);
  ctx.save();
  ctx.beginPath();
  ctx.rect(x, y, w, hgt);
  ctx.clip();
  ctx.strokeStyle = CRASHED;
  ctx.lineWidth = 1;
  for (let d = -hgt; d < w; d += 5) { ctx.moveTo(x + d, y + hgt); ctx.lineTo(x + d + hgt, y); }
  ctx.stroke();
  ctx.restore();
}

// draw `rows` with the colour `scale` ([lo, hi]: the page's, shared by its drill-downs);
// `marks` ({step}: a stall, a crash) as dashed red lines at their steps' columns
export function drawHeatmap(canvas, rows, buckets, scale, marks = []) {
  const [lo, hi] = scale || scaleOf(rows) || [0, 1];
  const cols = Math.max(1, (buckets || []).length || ((rows[0] && rows[0].cells.length) || 1));
  const dpr = window.devicePixelRatio || 1;
  const cssW = Math.max(320, canvas.clientWidth || 960);
  const cssH = Math.max(24, rows.length * ROW_H + AXIS_H);
  canvas.width = Math.round(cssW * dpr);
  canvas.height = Math.round(cssH * dpr);
  canvas.style.height = `${cssH}px`;
  const ctx = canvas.getContext("2d");
  ctx.setTransform(dpr, 0, 0, dpr, 0, 0);
  ctx.fillStyle = "#fff";
  ctx.fillRect(0, 0, cssW, cssH);
  const cw = (cssW - LABEL_W) / cols;
  ctx.font = "11px system-ui, sans-serif";
  ctx.textBaseline = "middle";
  rows.forEach((row, i) => {
    const y = i * ROW_H;
    (row.cells || []).forEach((v, j) => {
      const x = LABEL_W + j * cw;
      if (typeof v === "number" && Number.isFinite(v)) {
        ctx.fillStyle = color(hi > lo ? (v - lo) / (hi - lo) : 0.5);
        ctx.fillRect(x, y, Math.ceil(cw), ROW_H - 1);
      } else if (row.bad && row.kind === "rank") {
        hatch(ctx, x, y, Math.ceil(cw), ROW_H - 1); // no value: the rank crashed (or has no shard)
      } else {
        ctx.fillStyle = typeof v === "number" || typeof v === "string" ? NON_FINITE : NO_VALUE;
        ctx.fillRect(x, y, Math.ceil(cw), ROW_H - 1);
      }
    });
    if (row.bad) { ctx.fillStyle = CRASHED; ctx.fillRect(LABEL_W - 4, y, 3, ROW_H - 1); }
    ctx.fillStyle = row.bad ? CRASHED : "#333";
    const tag = row.kind === "rank" ? "" : ` (${KIND[row.kind] || row.kind} ${row.ranks})`;
    let text = `${row.label}${tag}`;
    while (text.length > 4 && ctx.measureText(text).width > LABEL_W - 10) text = `${text.slice(0, -2)}…`;
    ctx.fillText(text, 4, y + ROW_H / 2);
  });
  for (const m of marks) {
    const j = (buckets || []).findIndex((b) => b[0] <= m.step && m.step <= b[b.length - 1]);
    if (j < 0) continue;
    ctx.save();
    ctx.strokeStyle = CRASHED; ctx.lineWidth = 2; ctx.setLineDash([4, 3]);
    ctx.beginPath(); ctx.moveTo(LABEL_W + j * cw, 0); ctx.lineTo(LABEL_W + j * cw, rows.length * ROW_H); ctx.stroke();
    ctx.restore();
  }
  canvas.dataset.marks = String(marks.length);
  if (buckets && buckets.length) {
    ctx.fillStyle = "#666";
    const first = buckets[0], last = buckets[buckets.length - 1];
    const y = rows.length * ROW_H + AXIS_H / 2;
    ctx.fillText(`step ${first[0]}`, LABEL_W, y);
    const end = `step ${last[last.length - 1]}`;
    ctx.fillText(end, cssW - ctx.measureText(end).width - 2, y);
  }
  canvas.__rows = rows;
  canvas.__scale = [lo, hi];
  canvas.dataset.rows = String(rows.length);
}

// the row list beside the canvas, for a reader and a test: what each row is, in order
export function drawRowList(el, rows) {
  replace(el, h("ol", { class: "rowlist" }, rows.map((r) => h("li", { class: r.bad ? "bad" : "", "data-kind": r.kind },
    r.label, r.kind !== "rank" ? h("span", { class: "muted" }, ` ${KIND[r.kind] || r.kind} ${r.ranks}`) : null,
    r.note ? h("span", { class: "state" }, ` ${r.note}`) : null))));
}

export function drawLegend(el, scale) {
  if (!el) return;
  const [lo, hi] = scale || [null, null];
  replace(el,
    lo === null ? "no values" : `${num(lo)} (dark) – ${num(hi)} (light), one scale for the page and its drill-downs; `,
    h("span", { class: "swatch none" }), " no value; ", h("span", { class: "swatch nonfinite" }), " NaN or inf; ",
    h("span", { class: "swatch crashed" }), " crashed or no shard");
}

export function rowAt(canvas, ev) {
  const rect = canvas.getBoundingClientRect();
  const i = Math.floor((ev.clientY - rect.top) / ROW_H);
  return (canvas.__rows || [])[i] || null;
}
