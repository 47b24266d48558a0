// The metric picker: rank-record keys (flagged ones first), else the keys of the step rows.
import { h, replace } from "./dom.js";

export function metricKeys(summary) {
  if (summary.keys) {
    return summary.keys.slice().sort((a, b) => (b.n_flagged || 0) - (a.n_flagged || 0)).map((k) => k.key);
  }
  const keys = new Set();
  for (const row of summary.last || []) {
    for (const [k, v] of Object.entries(row.values || {})) if (typeof v === "number") keys.add(k);
  }
  return [...keys].sort();
}

export function drawPicker(el, keys, chosen, onPick) {
  replace(el, keys.map((k) => h("option", { value: k, selected: k === chosen }, k)));
  el.onchange = () => onPick(el.value);
}
