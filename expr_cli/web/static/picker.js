// The metric picker: the step rows' keys (`loss`, every et.log key) first, then the rank
// records' keys (flagged ones first), each group under its name.
import { h, replace } from "./dom.js";

export function metricGroups(summary) {
  const items = summary.keys || [];
  const records = items.filter((k) => k.source !== "step rows")
    .sort((a, b) => (b.n_flagged || 0) - (a.n_flagged || 0)).map((k) => k.key);
  const rows = [...(summary.step_keys || []), ...items.filter((k) => k.source === "step rows").map((k) => k.key)];
  if (!items.length) {
    for (const row of summary.last || []) {
      for (const [k, v] of Object.entries(row.values || {})) if (typeof v === "number") rows.push(k);
    }
  }
  const stepRows = [...new Set(rows)].filter((k) => !records.includes(k));
  return { stepRows, records };
}

export function metricKeys(summary) {
  const g = metricGroups(summary);
  return [...g.stepRows, ...g.records];
}

export function drawPicker(el, summary, chosen, onPick) {
  const g = metricGroups(summary);
  const opts = (keys) => keys.map((k) => h("option", { value: k, selected: k === chosen }, k));
  replace(el, g.stepRows.length ? h("optgroup", { label: "step rows" }, opts(g.stepRows)) : null,
    g.records.length ? h("optgroup", { label: "rank records" }, opts(g.records)) : null);
  el.onchange = () => onPick(el.value);
}
