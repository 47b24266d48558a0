// The per-rank snapshot, worst first (as `expr top`): status, step, behind, steps/s, last
// write, incident, and whether the rank is noisier than the others (issue 21). A crashed
// rank is neither behind nor stepping (no steps/s); the rank that failed first leads.
import { age, badge, h, num, replace } from "./dom.js";

const SHOWN = 24; // rows drawn (top sends the worst 64)

// `noisier`: rank -> "CV 0.31 vs 0.04 median" (noisier.js), a last column when any is
export function drawRanks(el, top, noisier = new Map()) {
  const rows = top.ranks || [];
  const root = top.job && top.job.first_crash ? top.job.first_crash.rank : null;
  const dead = (r) => r.status === "crashed";
  const table = h("table", { class: "grid", id: "rank-table" },
    h("thead", {}, h("tr", {}, ["rank", "host", "status", "step", "behind", "steps/s", "last write", "incident",
      ...(noisier.size ? ["noisier"] : [])]
      .map((c, i) => h("th", { class: i >= 3 && i <= 6 ? "num" : "" }, c)))),
    h("tbody", {}, rows.slice(0, SHOWN).map((r) => h("tr", { class: dead(r) ? "dead" : null, "data-rank": r.rank },
      h("td", {}, `rank ${r.rank}`, r.rank === root ? h("span", { class: "root" }, " failed first") : null),
      h("td", { class: "muted" }, r.host || ""),
      h("td", {}, badge(r.status)), h("td", { class: "num" }, r.step ?? "–"),
      h("td", { class: "num" }, dead(r) ? "–" : r.behind ? r.behind.toLocaleString("en-US") : "0"),
      h("td", { class: "num" }, dead(r) ? "–" : num(r.steps_per_s, 3)),
      h("td", { class: "num" }, r.last_write_age === null ? "–" : `${age(r.last_write_age)} ago`),
      h("td", {}, r.incident ? badge(r.incident) : ""),
      noisier.size ? h("td", { class: "noisier" }, noisier.get(r.rank) || "") : null))));
  const total = top.ranks_total ?? rows.length;
  const more = total > SHOWN
    ? h("p", { class: "muted" }, `and ${(total - SHOWN).toLocaleString("en-US")} more ranks on `
      + `${(top.nodes_total ?? (top.nodes || []).length).toLocaleString("en-US")} nodes`) : null;
  replace(el, table, more);
}
