// The tiles: ranks reporting n/world (a crashed rank counted as crashed, not behind),
// weighted mean against mean (and whether the gap is more than the spread explains),
// spread p05-p95, range (max - min), std.
import { h, num, replace } from "./dom.js";

function tile(label, value, sub, id, cls) {
  return h("div", { class: cls ? `tile ${cls}` : "tile", id }, h("div", { class: "label" }, label),
    h("div", { class: "value" }, value), h("div", { class: "sub" }, sub));
}

export function drawTiles(el, summary, key) {
  const item = (summary.keys || []).find((k) => k.key === key) || (summary.keys || [])[0];
  if (!item) { replace(el, tile("ranks reporting", "–", "no values", "tile-ranks")); return; }
  const s = item.stats || {};
  const world = summary.world_size || s.world;
  const crashed = new Set(((summary.ranks || {}).crashed) || []);
  const missing = (item.missing || []).filter((r) => !crashed.has(r)).length;
  const behind = (item.behind || []).filter((b) => b.status !== "crashed" && !crashed.has(b.rank)).length;
  const where = summary.step !== null && summary.step !== undefined ? `at step ${summary.step}`
    : `mean over steps ${summary.steps[0]}-${summary.steps[1] - 1}`;
  const gap = s.mean && s.wmean !== null && s.wmean !== undefined && typeof s.mean === "number"
    ? `${(((s.wmean - s.mean) / Math.abs(s.mean)) * 100).toFixed(2)}% from the mean` : "";
  // issue 21: does the gap exceed what the spread explains (z x std/sqrt(n))?
  const w = item.weighted;
  const verdict = !w ? "" : w.differs
    ? `differs: more than ${num(w.z)} x std/sqrt(n) = ${num(w.z * w.se)}; the weights go with the values`
    : `within the spread (${num(w.z)} x std/sqrt(n) = ${num(w.z * w.se)})`;
  replace(el,
    tile("ranks reporting", `${s.n ?? 0}/${world ?? "?"}`,
      [where, behind ? `${behind} behind` : "", crashed.size ? `${crashed.size} crashed` : "",
        missing ? `${missing} missing` : ""].filter(Boolean).join(" · "),
      "tile-ranks", crashed.size ? "bad" : null),
    tile("weighted mean vs mean", `${num(s.wmean)} vs ${num(s.mean)}`,
      [gap, verdict].filter(Boolean).join(" · "), "tile-means", w && w.differs ? "warn" : null),
    tile("spread p05-p95", `${num(s.p05)} – ${num(s.p95)}`, `p50 ${num(s.p50)}`, "tile-spread"),
    tile("range", typeof s.max === "number" && typeof s.min === "number" ? num(s.max - s.min) : "–",
      `min ${num(s.min)} · max ${num(s.max)}`, "tile-range"),
    tile("std", num(s.std), `across ${s.n ?? 0} ranks`, "tile-std"));
}
