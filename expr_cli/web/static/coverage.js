// Coverage per step: the steps of the window that miss ranks, runs of steps missing the
// same ranks as one line ("steps 180-199: missing rank 17", as `expr summary` groups them).
import { h, ranksText, replace } from "./dom.js";

export function coverageRuns(rows) {
  const out = [];
  for (const r of rows) {
    const prev = out[out.length - 1];
    if (prev && prev.world === r.world && prev.missing.join(",") === r.missing.join(",") && r.step > prev.last) {
      prev.last = r.step; prev.steps += 1;
    } else out.push({ first: r.step, last: r.step, steps: 1, reported: r.reported, world: r.world, missing: r.missing });
  }
  return out;
}

export function drawCoverage(el, note, summary) {
  const checked = summary.coverage_checked || {};
  note.textContent = checked.steps ? `${checked.steps} steps checked (${checked.first}..${checked.last})` : "";
  const runs = coverageRuns(summary.coverage || []);
  const ranks = summary.ranks || {};
  const crashed = new Set(ranks.crashed || []);
  const behind = (ranks.behind || []).filter((b) => b.status !== "crashed" && !crashed.has(b.rank));
  const parts = [];
  if (!runs.length) parts.push(h("p", { class: "muted", id: "coverage-ok" }, "every rank reported every step checked"));
  else {
    parts.push(h("ul", { class: "list", id: "coverage-runs" }, runs.slice(-20).reverse().map((c) => {
      const why = c.missing.filter((r) => crashed.has(r)).length === c.missing.length ? " (crashed)" : "";
      return h("li", {}, h("span", { class: "mono" }, c.first === c.last ? `step ${c.first}` : `steps ${c.first}-${c.last}`),
        `: missing rank${c.missing.length > 1 ? "s" : ""} ${ranksText(c.missing)}${why}`,
        h("span", { class: "muted" }, ` · ${c.reported}/${c.world} reported`));
    })));
  }
  if (behind.length) {
    parts.push(h("p", { class: "muted" }, `behind the step: ${behind.slice(0, 12).map((b) => `rank ${b.rank} (step ${b.step ?? "–"})`).join(", ")}${behind.length > 12 ? ` and ${behind.length - 12} more` : ""}`));
  }
  replace(el, parts);
}
