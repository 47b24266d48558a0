// The run page's header: the run, its frontier as `step N`, its status, the live marker.

export function drawHeader(label, summary, top) {
  document.getElementById("run-label").textContent = label;
  document.title = `expr · ${label}`;
  const ranks = (summary && summary.ranks) || {};
  const frontier = ranks.frontier ?? (top && top.frontier) ?? (summary && summary.step);
  document.getElementById("frontier").textContent = frontier === null || frontier === undefined ? "" : `step ${frontier}`;
  const crashed = (ranks.crashed || []).length;
  const status = crashed ? "crashed" : ranks.live ? "running" : (ranks.shards ? "finished" : "");
  const el = document.getElementById("run-status");
  el.textContent = status;
  el.className = `badge ${status}`;
  el.hidden = !status;
}

export function drawLive(text) {
  document.getElementById("live").textContent = text;
}
