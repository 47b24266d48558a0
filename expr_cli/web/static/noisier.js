// Is a rank noisier? (issue 21) The picked key's variability over the chart's steps, as
// `expr summary -m KEY --steps A:B --json` carries it: each rank's std or CV across the
// window, and the ranks whose variability is an outlier among the ranks (DESIGN 10's rule).
import { h, num, replace } from "./dom.js";

function fmt(by, v) { return `${by === "cv" ? "CV" : "std"} ${num(v, by === "cv" ? 2 : 3)}`; }

// rank -> "CV 0.31 vs 0.04 median", for the per-rank snapshot's column
export function noisierByRank(view) {
  const out = new Map();
  const item = view && (view.keys || [])[0];
  const v = item && item.variability;
  if (!v) return out;
  for (const o of v.noisier || []) out.set(o.rank, `${fmt(v.by, o[v.by])} vs ${num(v.median, v.by === "cv" ? 2 : 3)} median`);
  return out;
}

export function drawNoisier(el, view) {
  const item = view && (view.keys || [])[0];
  const v = item && item.variability;
  if (!v || !v.n_ranks) { replace(el); return; }
  const where = `${item.key}, steps ${view.steps.join(":")}`;
  if (!(v.noisier || []).length) {
    replace(el, h("p", { class: "muted", id: "noisier-none" },
      `no rank noisier (${where}: ${v.by === "cv" ? "CV" : "std"} of each rank across the steps; median ${num(v.median, v.by === "cv" ? 2 : 3)})`));
    return;
  }
  replace(el, h("h3", {}, "Noisier ", h("span", { class: "muted" }, where)),
    h("ul", { class: "list", id: "noisier-list" }, v.noisier.map((o) => h("li", { class: "outlier" },
      h("strong", {}, `rank ${o.rank}`), o.node ? h("span", { class: "muted" }, ` ${o.node}`) : null,
      ` noisier: ${fmt(v.by, o[v.by])} vs ${num(v.median, v.by === "cv" ? 2 : 3)} median`))));
}
