// The Settings page's recommendation panel: `dgxmm tune` on the last 24 hours
// (POST /api/settings/tune, dgxmm/admin/tuning.py) and its trade-off curve, drawn with
// uPlot (js/vendor.js). Only a safe point is recommended (infeasible ones are listed with
// their reason); Apply changes the settings (POST /api/settings/tune/apply: one audited
// event holding the prediction), and "Since applied" puts that prediction beside what
// happened since, with an Undo (POST /api/settings/tune/undo).

import { api, describeError } from "../api.js";
import { h, replace } from "../dom.js";
import { dateTime, relativeTime } from "../format.js";
import { chartUnavailable, loadUPlot } from "../vendor.js";
import { busy } from "./common.js";

const GOALS = [
  ["p90<=30,cold_starts", "p90 wait ≤ 30 s, fewest cold starts"],
  ["p99<=120,idle_gib_hours", "p99 wait ≤ 2 min, fewest idle GiB-hours"],
  ["p90<=10,cold_starts", "p90 wait ≤ 10 s, fewest cold starts"],
];

// The goal's objective -> [the figure it makes least, its words with their unit].
const OBJECTIVES = {
  cold_starts: ["cold_starts_per_hour", "cold starts per hour"],
  idle_gib_hours: ["idle_gib_hours_per_hour", "idle GiB-hours per hour"],
  evictions: ["evictions_per_hour", "evictions per hour"],
  p90: ["p90", "p90 wait (s)"],
  p99: ["p99", "p99 wait (s)"],
};

// One row per figure, one unit each: [words, value of a figures object].
const ROWS = [
  ["Requests", (f) => `${f.requests} over ${f.hours.toFixed(1)} h`],
  ["p90 wait", (f) => `${f.p90.toFixed(1)} s`],
  ["Worst model's p90 wait", (f) => `${f.worst_p90.toFixed(1)} s${f.worst_model ? ` (${f.worst_model})` : ""}`],
  ["Cold starts", (f) => `${f.cold_starts_per_hour.toFixed(1)} per hour`],
  ["Idle GiB-hours", (f) => `${f.idle_gib_hours_per_hour.toFixed(1)} per hour`],
  ["Served", (f) => String(f.fates.served)],
  ["Refused", (f) => String(f.fates.refused)],
  ["Timed out in the queue", (f) => String(f.fates.timed_out)],
  ["Stopped by an administrator", (f) => String(f.fates.stopped)],
];

function figuresTable(id, heads, columns) {
  return h(`table.tune-figures#${id}`, [
    h("thead", h("tr", [h("th", { scope: "col" }, "Figure"), ...heads.map((x) => h("th", { scope: "col" }, x))])),
    h(
      "tbody",
      ROWS.map(([words, value]) => h("tr", [h("th", { scope: "row" }, words), ...columns.map((f) => h("td", f ? value(f) : "—"))])),
    ),
  ]);
}

// Each model's fates, one row per model: "120 served, 3 refused" (the others where any).
function fatesText(f) {
  if (!f) return "—";
  const parts = [`${f.served} served`];
  if (f.refused) parts.push(`${f.refused} refused`);
  if (f.timed_out) parts.push(`${f.timed_out} timed out`);
  if (f.stopped) parts.push(`${f.stopped} stopped`);
  return parts.join(", ");
}

function fatesTable(id, heads, columns) {
  const per = columns.map((f) => (f && f.fates_per_model) || {});
  const models = [...new Set(per.flatMap((p) => Object.keys(p)))].sort();
  return h(`table.tune-figures#${id}`, [
    h("thead", h("tr", [h("th", { scope: "col" }, "Model"), ...heads.map((x) => h("th", { scope: "col" }, x))])),
    h(
      "tbody",
      models.map((name) => h("tr", [h("th", { scope: "row" }, name), ...per.map((p) => h("td", fatesText(p[name])))])),
    ),
  ]);
}

export function tunePanel() {
  const body = h("div#tune-body", h("p.muted", "Simulates the last 24 hours of traffic under about 20 settings; this takes a while. Only a setting that lets every model start and serves every request the box served is recommended."));
  const since = h("div#tune-since");
  const goal = h("select#tune-goal", { "aria-label": "Goal" }, GOALS.map(([value, label]) => h("option", { value }, label)));
  const run = h("button#tune-run", { type: "button" }, "Recommend");
  run.addEventListener("click", async () => {
    run.disabled = true;
    replace(body, h("p.muted", { role: "status" }, "Simulating…"));
    try {
      draw(body, await api("POST", "settings/tune", { body: { goal: goal.value, fresh: true } }), () => showApplied(since));
    } catch (err) {
      replace(body, h("p.error", describeError(err)));
    } finally {
      run.disabled = false;
    }
  });
  showApplied(since);
  return h("section.card.tune-card", { "aria-labelledby": "tune-title" }, [
    h("h2#tune-title", "Recommended settings (last 24 h)"),
    h("div.tune-row", [goal, run]),
    body,
    since,
  ]);
}

function draw(body, result, onApplied) {
  const goal = result.goal;
  const best = result.recommended;
  const [key, unit] = OBJECTIVES[goal.minimise];
  const infeasible = result.points.filter((p) => !p.feasible);
  const words = [h("p.hint", `Searched ${result.searched}.`)];
  if (!result.baseline.feasible) {
    words.push(h("p.error#tune-baseline-unsafe", `The settings as they are are not safe either: ${result.baseline.infeasible}.`));
  }
  if (!best) {
    words.push(h("p#tune-recommended", "No safe setting meets this goal; the curve shows the nearest."));
  } else if (Object.keys(best.settings).length === 0) {
    words.push(h("p#tune-recommended", [h("strong", "Recommended: "), "keep the settings as they are."]));
  } else {
    const error = h("p.error", { role: "alert", hidden: true });
    const apply = h("button.primary#tune-apply", { type: "button" }, "Apply");
    apply.addEventListener("click", async () => {
      const done = await busy(
        apply,
        "Applying…",
        () =>
          api("POST", "settings/tune/apply", {
            body: {
              settings: best.settings,
              changes: best.changes,
              label: best.label,
              goal: goalWords(goal),
              prediction: best.figures,
              baseline: result.baseline.figures,
            },
          }),
        error,
      );
      if (done) onApplied();
    });
    words.push(
      h("p#tune-recommended", [h("strong", "Recommended: "), best.label]),
      h("ul.tune-changes", best.changes.map((c) => h("li", h("code", c)))),
      figuresTable("tune-trade", ["As now", "Recommended"], [result.baseline.figures, best.figures]),
      fatesTable("tune-trade-models", ["As now", "Recommended"], [result.baseline.figures, best.figures]),
      h("div.actions", apply),
      error,
    );
  }
  if (infeasible.length) {
    words.push(
      h("details.tune-infeasible", [
        h("summary", `${infeasible.length} settings are not safe (never recommended)`),
        h("ul", infeasible.map((p) => h("li", [h("strong", p.label), `: ${p.infeasible}`]))),
      ]),
    );
  }
  const chart = h("div#tune-chart", { "data-points": String(result.points.length) });
  replace(body, [...words, chart]);
  const points = result.points.filter((p) => p.figures && p.feasible).sort((a, b) => a.figures[key] - b.figures[key]);
  loadUPlot()
    .then((uPlot) => {
      const xs = points.map((p) => p.figures[key]);
      const all = points.map((p) => p.figures[goal.bound]);
      const front = points.map((p) => (p.pareto ? p.figures[goal.bound] : null));
      new uPlot(
        {
          width: Math.max(320, chart.clientWidth || 560),
          height: 240,
          scales: { x: { time: false } },
          axes: [{ label: unit }, { label: `${goal.bound} wait (s)` }],
          series: [
            {},
            { label: "safe setting", stroke: "#888", paths: () => null, points: { show: true, size: 6 } },
            { label: "Pareto front", stroke: "#2a6", width: 2, spanGaps: true, points: { show: true, size: 8 } },
          ],
        },
        [xs, all, front],
        chart,
      );
    })
    .catch((err) => replace(chart, chartUnavailable(err)));
}

function goalWords(goal) {
  return `${goal.bound} wait ≤ ${goal.limit_s} s, fewest ${OBJECTIVES[goal.minimise][1]}`;
}

// --- since applied ---------------------------------------------------------------------------

async function showApplied(box) {
  let found;
  try {
    found = (await api("GET", "settings/tune/applied")).applied;
  } catch (err) {
    replace(box, h("p.error", describeError(err)));
    return;
  }
  if (!found) {
    replace(box);
    return;
  }
  const head = h("h3", "Since applied");
  const who = [`Applied ${dateTime(found.at)} (`, relativeTime(found.at), `) by ${found.by}: ${found.label}.`];
  if (found.undone_at) {
    replace(box, head, h("p.muted#tune-undone", [...who, ` Undone ${dateTime(found.undone_at)} by ${found.undone_by}.`]));
    return;
  }
  const since = found.since;
  const traffic = since
    ? `What happened since: ${since.requests} requests over ${since.hours.toFixed(2)} h of traffic, measured as the recorded column is.`
    : `Nothing to compare yet: ${found.since_error || "no traffic since"}.`;
  const error = h("p.error", { role: "alert", hidden: true });
  const undo = h("button.secondary#tune-undo", { type: "button" }, "Undo");
  undo.addEventListener("click", async () => {
    const done = await busy(undo, "Undoing…", () => api("POST", "settings/tune/undo"), error);
    if (done) showApplied(box);
  });
  replace(
    box,
    head,
    h("p", who),
    h("p.hint", traffic),
    figuresTable("tune-since-table", ["Predicted", "Since applied"], [found.prediction, since]),
    fatesTable("tune-since-models", ["Predicted", "Since applied"], [found.prediction, since]),
    h("div.actions", undo),
    error,
  );
}
