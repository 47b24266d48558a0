// The JSON API (DESIGN 18): one fetch helper; an error answer carries {"error": "..."}.

export class ApiError extends Error {
  constructor(status, message) { super(message); this.status = status; }
}

export async function get(path, params = {}) {
  const q = new URLSearchParams();
  for (const [k, v] of Object.entries(params)) {
    if (v === null || v === undefined || v === "") continue;
    for (const one of Array.isArray(v) ? v : [v]) q.append(k, one);
  }
  const url = q.toString() ? `${path}?${q}` : path;
  return answerOf(await fetch(url, { credentials: "same-origin", headers: { accept: "application/json" } }));
}

// a response's JSON, or its error as an ApiError
export async function answerOf(resp) {
  let body = null;
  try { body = await resp.json(); } catch { body = null; }
  if (!resp.ok) throw new ApiError(resp.status, (body && body.error) || `${resp.status} ${resp.statusText}`);
  return body;
}

export function runPath(project, name) {
  return `/api/runs/${encodeURIComponent(project)}/${encodeURIComponent(name)}`;
}
