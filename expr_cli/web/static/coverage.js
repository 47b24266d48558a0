// Coverage per step: the recent steps that miss ranks, and which ranks.
import { h, ranksText, replace } from "./dom.js";

export function drawCoverage(el, note, summary) {
  const checked = summary.coverage_checked || {};
  note.textContent = checked.steps ? `last ${checked.steps} steps (${checked.first}..${checked.last})` : "";
  const rows = summary.coverage || [];
  const behind = ((summary.ranks || {}).behind || []);
  const parts = [];
  if (!rows.length) parts.push(h("p", { class: "muted", id: "coverage-ok" }, "every rank reported every step checked"));
  else {
    parts.push(h("ul", { class: "list" }, rows.slice(-20).reverse().map((c) =>
      h("li", {}, h("span", { class: "mono" }, `step ${c.step}`), ` ${c.reported}/${c.world} reported · missing rank${c.missing.length > 1 ? "s" : ""} ${ranksText(c.missing)}`))));
  }
  if (behind.length) {
    parts.push(h("p", { class: "muted" }, `behind the step: ${behind.slice(0, 12).map((b) => `rank ${b.rank} (step ${b.step ?? "–"})`).join(", ")}${behind.length > 12 ? ` and ${behind.length - 12} more` : ""}`));
  }
  replace(el, parts);
}
