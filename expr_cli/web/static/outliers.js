// Outliers of every key at the step: `rank N` (node), value, its delta from the mean, x
// median, robust score.
import { h, num, replace } from "./dom.js";

export function drawOutliers(el, summary) {
  const items = [];
  for (const k of summary.keys || []) {
    const mean = (k.stats || {}).mean;
    for (const o of k.outliers || []) {
      items.push({ key: k.key, ...o, delta: typeof mean === "number" && typeof o.value === "number" ? o.value - mean : null });
    }
  }
  if (!items.length) {
    replace(el, h("p", { class: "muted" }, `no outliers (robust score > ${summary.threshold} and at least ${Math.round((summary.min_rel || 0) * 100)}% from the median)`));
    return;
  }
  replace(el, h("ul", { class: "list", id: "outlier-list" }, items.map((o) =>
    h("li", { class: "outlier" },
      h("strong", {}, `rank ${o.rank}`), o.node ? h("span", { class: "muted" }, ` ${o.node}`) : null,
      " ", h("span", { class: "mono" }, o.key), ` ${num(o.value)}`,
      o.delta !== null ? h("span", { class: "delta" }, ` · ${o.delta >= 0 ? "+" : "−"}${num(Math.abs(o.delta), 3)} from the mean`) : null,
      o.ratio !== null && o.ratio !== undefined ? h("span", {}, ` · ${num(o.ratio, 3)}x median`) : null,
      o.robust !== null && o.robust !== undefined ? h("span", { class: "muted" }, ` · robust ${num(o.robust, 3)}`) : null))));
}
