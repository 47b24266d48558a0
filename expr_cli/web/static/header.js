// The run page's header: the run, its frontier as `step N`, its state (running, stalled,
// crashed, finished: the job line of `expr top` once its detectors ran), "no step for N s"
// of a live run whose ranks have not advanced for a while, a lost node, the
// stalls found after the fact in a finished run's files, and the live marker.
import { age, h, ranksText, replace } from "./dom.js";

export function drawHeader(label, summary, top) {
  document.getElementById("run-label").textContent = label;
  document.title = `expr · ${label}`;
  const ranks = (summary && summary.ranks) || {};
  const frontier = ranks.frontier ?? (top && top.frontier) ?? (summary && summary.step);
  document.getElementById("frontier").textContent = frontier === null || frontier === undefined ? "" : `step ${frontier}`;
  const crashed = (ranks.crashed || []).length;
  // a job-wide silence's ranks are not live (the summary counts them apart), nor finished
  let status = crashed ? "crashed" : ranks.live ? "running" : ranks.silent ? "silent" : (ranks.shards ? "finished" : "");
  let text = "";
  const job = top && !top.reading ? top.job : null;
  if (job && job.state && job.state !== "reading") { status = job.state; text = job.text || ""; }
  const el = document.getElementById("run-status");
  el.textContent = status;
  el.className = `badge ${status === "stalled" ? "stall" : status}`;
  el.title = text;
  el.hidden = !status;
  const notes = [];
  if (job && job.state === "stalled") notes.push(h("span", { class: "badge stall long", id: "stall-badge", title: job.text }, job.text));
  // issue 48: no live rank took a step for a while, though their files are written (probes,
  // samples): said before any incident opens, as `expr top` says it
  if (job && job.state === "running" && typeof job.no_step_for === "number") {
    notes.push(h("span", { class: "badge stall", id: "no-step-badge", title: job.text }, `no step for ${age(job.no_step_for)}`));
  }
  // a node lost whole: its ranks and its exprd silent while the others wait
  const lost = ((top && top.incidents) || []).filter((i) => i.kind === "lost" && i.state !== "resolved");
  for (const inc of lost.slice(0, 3)) {
    const rs = inc.ranks || [];
    notes.push(h("span", { class: "badge missing", id: `lost-node-${(inc.hosts || ["node"])[0]}`, title: inc.detail || "" },
      `lost: ${(inc.hosts || []).join(", ") || "a node"} (rank${rs.length > 1 ? "s" : ""} ${ranksText(rs)})`));
  }
  // a lost node: ranks that never wrote a shard (missing), or went silent while others ran (hang)
  for (const [kind, what] of [["missing", "never wrote a shard"], ["hang", "silent"]]) {
    const incs = ((top && top.incidents) || []).filter((i) => i.kind === kind);
    if (!incs.length) continue;
    const rs = [...new Set(incs.flatMap((i) => i.ranks || []))].sort((a, b) => a - b);
    const hosts = [...new Set(incs.flatMap((i) => i.hosts || []))];
    notes.push(h("span", { class: "badge missing", id: `lost-${kind}`, title: incs[0].detail || "" },
      `lost: rank${rs.length > 1 ? "s" : ""} ${ranksText(rs)}${hosts.length ? ` on ${hosts.slice(0, 2).join(", ")}` : ""} ${what}`));
  }
  const found = (summary && summary.found && summary.found.stalls) || [];
  if (found.length) {
    const s = found[0];
    notes.push(h("span", { class: "badge stall", id: "found-badge", title: "no watcher followed this run: found in its files" },
      `stalled ${age(s.gap_s)} before step ${s.step}${found.length > 1 ? ` (+${found.length - 1} more)` : ""}, found after the fact`));
  }
  replace(document.getElementById("run-notes"), notes);
}

export function drawLive(text) {
  document.getElementById("live").textContent = text;
}
