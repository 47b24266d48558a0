// Small DOM and number helpers shared by the panels: text only (never innerHTML), so run
// names, metric keys and incident details are shown as written.

export function h(tag, attrs = {}, ...children) {
  const el = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) {
    if (v === null || v === undefined || v === false) continue;
    if (k === "class") el.className = v;
    else if (k.startsWith("on")) el.addEventListener(k.slice(2), v);
    else el.setAttribute(k, v === true ? "" : String(v));
  }
  for (const c of children.flat()) {
    if (c === null || c === undefined || c === false) continue;
    el.append(c instanceof Node ? c : document.createTextNode(String(c)));
  }
  return el;
}

export function replace(el, ...children) {
  el.replaceChildren(...children.flat().filter((c) => c !== null && c !== undefined));
}

export function num(x, digits = 4) {
  if (x === null || x === undefined) return "–";
  if (typeof x === "string") return x; // "NaN", "Infinity" as the API spells them
  if (Number.isInteger(x) && Math.abs(x) < 1e15) return x.toLocaleString("en-US");
  const a = Math.abs(x);
  if (a !== 0 && (a < 1e-3 || a >= 1e6)) return x.toExponential(2);
  return Number(x.toPrecision(digits)).toString();
}

export function age(seconds) {
  if (seconds === null || seconds === undefined) return "–";
  if (seconds < 60) return `${Math.round(seconds)}s`;
  if (seconds < 3600) return `${Math.round(seconds / 60)}m`;
  if (seconds < 86400) return `${(seconds / 3600).toFixed(1)}h`;
  return `${Math.round(seconds / 86400)}d`;
}

export function badge(text, cls) {
  return h("span", { class: `badge ${cls || text || ""}` }, text ?? "–");
}

export function ranksText(ranks) {
  // [0,1,2,5] -> "0-2,5" (as the CLI's compact ranks)
  if (!Array.isArray(ranks) || !ranks.length) return "";
  const out = [];
  let lo = ranks[0], prev = ranks[0];
  for (const r of ranks.slice(1).concat([null])) {
    if (r !== null && r === prev + 1) { prev = r; continue; }
    out.push(lo === prev ? `${lo}` : `${lo}-${prev}`);
    lo = prev = r;
  }
  return out.join(",");
}
