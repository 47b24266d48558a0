// The step window is the user's (issue 44): the last N steps (`?last=N`), a range brushed on
// the chart (`?steps=A:B`, half-open), or the whole run (`?steps=all`), kept in the URL;
// every panel asks the API for the same window.
import { h, replace } from "./dom.js";

export const DEFAULT_LAST = 50; // the API's own window: the frontier step, the last 50 for the chart
const CHOICES = [50, 200, 1000];

export function readWindow(search = window.location.search) {
  const q = new URLSearchParams(search);
  const steps = q.get("steps");
  if (steps === "all") return { kind: "all" };
  const m = /^(\d+):(\d+)$/.exec(steps || "");
  if (m && Number(m[2]) > Number(m[1])) return { kind: "range", lo: Number(m[1]), hi: Number(m[2]) };
  const n = Number(q.get("last"));
  return { kind: "last", n: Number.isInteger(n) && n > 0 ? n : DEFAULT_LAST };
}

// the API's `steps` parameter for the window (null: the API's default, the last 50)
export function apiSteps(win, frontier) {
  if (win.kind === "all") return ":";
  if (win.kind === "range") return `${win.lo}:${win.hi}`;
  if (win.n === DEFAULT_LAST || frontier === null || frontier === undefined) return null;
  return `${Math.max(0, frontier - win.n + 1)}:${frontier + 1}`;
}

export function describe(win) {
  if (win.kind === "all") return "the whole run";
  if (win.kind === "range") return `steps ${win.lo}-${win.hi - 1}`;
  return `the last ${win.n} steps`;
}

export function setWindow(win) {
  const q = new URLSearchParams(window.location.search);
  q.delete("steps"); q.delete("last");
  if (win.kind === "all") q.set("steps", "all");
  else if (win.kind === "range") q.set("steps", `${win.lo}:${win.hi}`);
  else if (win.n !== DEFAULT_LAST) q.set("last", String(win.n));
  const s = q.toString();
  history.replaceState(null, "", `${window.location.pathname}${s ? `?${s}` : ""}`);
}

export function drawWindow(el, win, onPick) {
  const value = win.kind === "range" ? "range" : win.kind === "all" ? "all" : `last:${win.n}`;
  const opts = CHOICES.map((n) => h("option", { value: `last:${n}`, selected: value === `last:${n}` }, `last ${n} steps`));
  if (win.kind === "last" && !CHOICES.includes(win.n)) opts.push(h("option", { value, selected: true }, `last ${win.n} steps`));
  opts.push(h("option", { value: "all", selected: value === "all" }, "whole run"));
  if (win.kind === "range") opts.push(h("option", { value: "range", selected: true }, describe(win)));
  replace(el, opts);
  el.title = "or drag across the chart to pick a range";
  el.onchange = () => {
    const v = el.value;
    if (v === "range") return;
    onPick(v === "all" ? { kind: "all" } : { kind: "last", n: Number(v.split(":")[1]) });
  };
}
