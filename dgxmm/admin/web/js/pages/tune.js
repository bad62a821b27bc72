// The Settings page's recommendation panel: `dgxmm tune` on the last 24 hours
// (POST /api/settings/tune, dgxmm/admin/tuning.py) and its trade-off curve, drawn with
// uPlot (js/vendor.js). It recommends; nothing here changes a setting.

import { api, describeError } from "../api.js";
import { h, replace } from "../dom.js";
import { chartUnavailable, loadUPlot } from "../vendor.js";

const GOALS = [
  ["p90<=30,cold_starts", "p90 wait ≤ 30 s with the fewest cold starts"],
  ["p99<=120,idle_gib_hours", "p99 wait ≤ 2 min with the fewest GiB-hours idle"],
  ["p90<=10,cold_starts", "p90 wait ≤ 10 s with the fewest cold starts"],
];

export function tunePanel() {
  const body = h("div#tune-body", h("p.muted", "Simulates the last 24 hours of traffic under 30 settings; this takes a while."));
  const goal = h("select#tune-goal", GOALS.map(([value, label]) => h("option", { value }, label)));
  const run = h("button#tune-run", { type: "button" }, "Recommend");
  run.addEventListener("click", async () => {
    run.disabled = true;
    replace(body, h("p.muted", { role: "status" }, "Simulating…"));
    try {
      draw(body, await api("POST", "settings/tune", { body: { goal: goal.value, fresh: true } }));
    } catch (err) {
      replace(body, h("p.error", describeError(err)));
    } finally {
      run.disabled = false;
    }
  });
  return h("section.card", { "aria-labelledby": "tune-title" }, [
    h("h2#tune-title", "Recommended settings (last 24 h)"),
    h("div.row", [goal, run]),
    body,
  ]);
}

function draw(body, result) {
  const goal = result.goal;
  const best = result.recommended;
  const words = best
    ? [
        h("p#tune-recommended", [h("strong", "Recommended: "), best.label]),
        h("p.hint", `${goal.bound} wait ${best[goal.bound].toFixed(1)} s, ${best.cold_starts_per_hour.toFixed(1)} cold starts an hour, ${best.idle_gib_hours.toFixed(1)} GiB-hours idle. Nothing was changed.`),
      ]
    : [h("p#tune-recommended", "No point of the grid meets this goal; the curve shows the nearest.")];
  const chart = h("div#tune-chart", { "data-points": String(result.points.length) });
  replace(body, [...words, chart]);
  const points = [...result.points].sort((a, b) => a[goal.minimise] - b[goal.minimise]);
  loadUPlot()
    .then((uPlot) => {
      const xs = points.map((p) => p[goal.minimise]);
      const all = points.map((p) => p[goal.bound]);
      const front = points.map((p) => (p.pareto ? p[goal.bound] : null));
      new uPlot(
        {
          width: Math.max(320, chart.clientWidth || 560),
          height: 240,
          scales: { x: { time: false } },
          axes: [{ label: goal.minimise.replaceAll("_", " ") }, { label: `${goal.bound} wait (s)` }],
          series: [
            {},
            { label: "grid point", stroke: "#888", paths: () => null, points: { show: true, size: 6 } },
            { label: "Pareto front", stroke: "#2a6", width: 2, spanGaps: true, points: { show: true, size: 8 } },
          ],
        },
        [xs, all, front],
        chart,
      );
    })
    .catch((err) => replace(chart, chartUnavailable(err)));
}
