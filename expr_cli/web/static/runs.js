// The runs list: worst first (open incidents, crashed, live, finished), refreshed every 5 s.
import { get } from "./api.js";
import { age, badge, h, replace } from "./dom.js";

const ORDER = { crashed: 0, stale: 1, running: 2, spooled: 3, finished: 4 };
const selected = new Set();

function worstFirst(a, b) {
  return (b.open_incidents || 0) - (a.open_incidents || 0)
    || (ORDER[a.status] ?? 5) - (ORDER[b.status] ?? 5)
    || (b.last_write || 0) - (a.last_write || 0);
}

function row(run) {
  const label = `${run.project}/${run.name}`;
  const href = `/runs/${encodeURIComponent(run.project)}/${encodeURIComponent(run.name)}`;
  const box = h("input", { type: "checkbox", "aria-label": `select ${label}`, checked: selected.has(label) });
  box.addEventListener("change", () => { box.checked ? selected.add(label) : selected.delete(label); note(); });
  const now = Date.now() / 1000;
  return h("tr", { "data-run": label },
    h("td", {}, box),
    h("td", {}, h("a", { href }, label)),
    h("td", {}, badge(run.status || "?")),
    h("td", { class: "incidents" }, run.open_incidents ? h("span", { class: "bad" }, `${run.open_incidents} open`)
      : run.open_incidents === 0 ? "none"
      : h("span", { class: "muted", title: "no expr watch or exprd keeps incidents for this run; its page finds them itself" }, "not watched")),
    h("td", { class: "num" }, (run.ranks || []).length.toLocaleString("en-US")),
    h("td", { class: "num" }, run.last_step ?? "–"),
    h("td", { class: "num" }, run.last_write ? `${age(now - run.last_write)} ago` : "–"));
}

function note() {
  document.getElementById("compare-note").textContent =
    selected.size >= 2 ? `${selected.size} runs selected` : "select two or more runs above";
}

// the first visit: the run directories at once (`quick=1`, a listing), until the full
// list (every sidecar read: seconds for a run of 16,384 ranks) replaces them
let full = false;

function quickRow(run) {
  const label = `${run.project}/${run.name}`;
  const href = `/runs/${encodeURIComponent(run.project)}/${encodeURIComponent(run.name)}`;
  return h("tr", { "data-run": label, class: "quick" }, h("td", {}), h("td", {}, h("a", { href }, label)),
    h("td", {}, h("span", { class: "muted" }, "reading...")), h("td", {}),
    h("td", { class: "num" }, run.shards.toLocaleString("en-US")), h("td", {}), h("td", {}));
}

async function quick() {
  try {
    const runs = await get("/api/runs", { quick: 1 });
    if (full || !runs.length || !runs[0].quick) return;
    replace(document.querySelector("#runs tbody"), runs.map(quickRow));
    document.getElementById("count").textContent = `(${runs.length})`;
    document.getElementById("updated").textContent = "reading each run's sidecars...";
  } catch { /* the full list says what went wrong */ }
}

async function refresh() {
  try {
    const runs = await get("/api/runs");
    full = true;
    runs.sort(worstFirst);
    replace(document.querySelector("#runs tbody"), runs.map(row));
    document.getElementById("count").textContent = `(${runs.length})`;
    document.getElementById("empty").hidden = runs.length > 0;
    document.getElementById("updated").textContent = `updated ${new Date().toLocaleTimeString()}`;
    document.body.dataset.loaded = "1";
  } catch (err) {
    document.getElementById("updated").textContent = `error: ${err.message}`;
  }
}

document.getElementById("compare-form").addEventListener("submit", (ev) => {
  ev.preventDefault();
  if (selected.size < 2) { note(); return; }
  const q = new URLSearchParams();
  for (const r of selected) q.append("run", r);
  q.set("metric", document.getElementById("compare-metric").value.trim());
  window.location.href = `/compare?${q}`;
});

quick();
refresh();
setInterval(refresh, 5000);
