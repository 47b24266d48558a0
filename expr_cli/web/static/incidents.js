// Incidents: the open ones (`expr top`), then the resolved ones from incidents.jsonl. Kinds
// and fields this page does not know are shown as they come (kind, ranks, detail).
import { age, badge, h, ranksText, replace } from "./dom.js";

// why it resolved, when not its own detector ("run ended"), and how long it was open
function resolvedWhy(inc) {
  const why = inc.reason ? [String(inc.reason)] : [];
  if (typeof inc.first_seen === "number" && typeof inc.last_seen === "number" && inc.last_seen >= inc.first_seen) {
    why.push(`open ${age(inc.last_seen - inc.first_seen)}`);
  }
  return why.length ? h("span", { class: "muted" }, ` (${why.join(", ")})`) : null;
}

function line(inc) {
  const ranks = Array.isArray(inc.ranks) ? inc.ranks : [];
  const hosts = Array.isArray(inc.hosts) && inc.hosts.length ? ` (${inc.hosts.slice(0, 3).join(", ")}${inc.hosts.length > 3 ? ", ..." : ""})` : "";
  const root = inc.root && typeof inc.root === "object"
    ? h("div", { class: "muted" }, `first: rank ${inc.root.rank ?? "?"}${inc.root.host ? ` on ${inc.root.host}` : ""}: ${inc.root.type ?? ""} ${inc.root.message ?? ""}`) : null;
  return h("li", { class: `incident ${inc.state || ""}` },
    badge(String(inc.kind)), " ", badge(inc.state || "?"), " ",
    // (past 100 ranks the answer holds their count and ranges as text, not every number)
    ranks.length ? h("strong", {}, inc.ranks_cut ? `${inc.rank_count.toLocaleString("en-US")} ranks ${inc.ranks_text}`
      : `rank${ranks.length > 1 ? "s" : ""} ${ranksText(ranks)}`) : null, hosts,
    inc.step !== null && inc.step !== undefined ? h("span", { class: "muted" }, ` at step ${inc.step}`) : null,
    inc.state === "resolved" ? resolvedWhy(inc) : null,
    inc.detail ? h("div", {}, String(inc.detail)) : null, root);
}

export function drawIncidents(el, top) {
  const open = top.incidents || [];
  const seen = new Set();
  const resolved = [];
  for (const inc of top.history || []) {  // newest first: the latest line of each incident
    const key = inc.id ?? `${inc.kind}:${(inc.ranks || []).join(",")}`;
    if (seen.has(key)) continue;
    seen.add(key);
    if (inc.state === "resolved") resolved.push(inc);
  }
  const parts = [];
  parts.push(open.length ? h("ul", { class: "list", id: "open-incidents" }, open.map(line))
    : h("p", { class: "muted", id: "open-incidents" }, "no open incidents"));
  if (resolved.length) {
    parts.push(h("h3", { class: "muted" }, `resolved (${resolved.length})`));
    parts.push(h("ul", { class: "list" }, resolved.slice(0, 20).map(line)));
  }
  replace(el, parts);
}
