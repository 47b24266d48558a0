// The run page's first request, sent as soon as this module (which imports nothing) is
// loaded, before the page's other modules are: the tiles of a run of thousands of ranks
// (`summary?first=1`, issue 44) are what the page draws first, and the server starts its
// first read of the run with it. run.js takes the response (`window.firstSummary`).
const parts = window.location.pathname.split("/").filter(Boolean).map(decodeURIComponent);
if (parts[0] === "runs" && parts.length === 3) {
  const q = new URLSearchParams();
  const metric = new URLSearchParams(window.location.search).get("metric");
  if (metric) q.set("chart", metric);
  q.set("first", "1");
  const path = `/api/runs/${encodeURIComponent(parts[1])}/${encodeURIComponent(parts[2])}/summary?${q}`;
  window.firstSummary = fetch(path, { credentials: "same-origin", headers: { accept: "application/json" } });
  window.firstSummary.catch(() => {}); // (a network error: run.js asks again)
}
