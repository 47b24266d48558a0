// Post-mortem without a watcher (issue 44): what a finished run's files reveal after the
// fact, marked so: the stalls (a pause before a step in every checked rank's `_time`,
// `summary.found`) and the crashes (the ranks' exit records, the first to fail first).
import { age, badge, h, ranksText, replace } from "./dom.js";

export function foundMarks(summary) {
  const marks = [];
  for (const s of ((summary && summary.found) || {}).stalls || []) {
    marks.push({ step: s.step, label: `stalled ${age(s.gap_s)} (found after the fact)` });
  }
  return marks;
}

export function drawFound(el, summary, top) {
  const found = (summary && summary.found) || null;
  const ranks = (summary && summary.ranks) || {};
  const crashed = ranks.crashed || [];
  const first = ranks.first_crash;
  const items = [];
  for (const s of (found && found.stalls) || []) {
    items.push(h("li", { class: "incident found" }, badge("stall"), " ", badge("found after the fact", "found"),
      ` every rank paused ${age(s.gap_s)} between steps ${s.after} and ${s.step}`,
      h("span", { class: "muted" }, ` (ranks checked: ${ranksText(found.checked)}; a stall is a pause of ${age(found.threshold)} or more)`)));
  }
  // a crash the detectors report already (top's open incidents) is not repeated
  const known = new Set(((top && top.incidents) || []).filter((i) => i.kind === "crashed").flatMap((i) => i.ranks || []));
  const unseen = crashed.filter((r) => !known.has(r));
  if (unseen.length && found) {
    items.push(h("li", { class: "incident found" }, badge("crashed"), " ", badge("found after the fact", "found"),
      h("strong", {}, ` rank${unseen.length > 1 ? "s" : ""} ${ranksText(unseen)}`),
      first ? h("div", { class: "muted" }, `first: rank ${first.rank}${first.host ? ` on ${first.host}` : ""}: ${first.type ?? ""} ${first.message ?? ""}`) : null));
  }
  if (!found) { replace(el); return; }
  replace(el, h("h3", {}, "Found after the fact ", h("span", { class: "muted" }, "(in the run's files; no watcher needed)")),
    items.length ? h("ul", { class: "list", id: "found-list" }, items)
      : h("p", { class: "muted", id: "found-none" }, `no stall in the ranks' step times (checked ranks ${ranksText(found.checked)})`));
}
