// The compare page: one metric of several runs, aligned by step (median across ranks).
import uPlot from "/static/vendor/uplot/uPlot.esm.js";
import { ApiError, get } from "./api.js";
import { STEP_INCRS } from "./chart.js";
import { h, replace } from "./dom.js";

const PALETTE = ["#2b6cb0", "#c05621", "#2f855a", "#6b46c1", "#b83280", "#2c7a7b", "#975a16", "#4a5568"];
const q = new URLSearchParams(window.location.search);
const runs = q.getAll("run"), metric = q.get("metric") || "";

async function main() {
  document.getElementById("compare-title").textContent = runs.join(" · ");
  try {
    const data = await get("/api/compare", { run: runs, metric });
    document.getElementById("compare-metric").textContent = data.metric;
    const el = document.getElementById("chart");
    const series = [{ label: "step" }, ...data.runs.map((r, i) => ({ label: r.run, stroke: PALETTE[i % PALETTE.length], width: 2, spanGaps: true }))];
    new uPlot({ width: Math.max(320, el.clientWidth || 900), height: 340, scales: { x: { time: false } },
                axes: [{ label: "step", incrs: STEP_INCRS }, { label: data.metric }], series },
              [data.steps, ...data.runs.map((r) => r.values.map((v) => (typeof v === "number" ? v : null)))], el);
    replace(document.getElementById("compare-runs"), h("ul", { class: "list", id: "compare-list" }, data.runs.map((r, i) =>
      h("li", {}, h("span", { class: "mono" }, "■ ").valueOf(), h("a", { href: `/runs/${r.run.split("/").map(encodeURIComponent).join("/")}` }, r.run),
        h("span", { class: "muted" }, ` ${r.ranks} ranks, ${r.values.filter((v) => v !== null).length} steps`)))));
    document.querySelectorAll("#compare-list li .mono").forEach((el2, i) => { el2.style.color = PALETTE[i % PALETTE.length]; });
    document.body.dataset.loaded = "1";
  } catch (err) {
    const el = document.getElementById("missing");
    el.hidden = false;
    el.textContent = err instanceof ApiError ? `${err.message}.` : `error: ${err.message}`;
  }
}

main();
