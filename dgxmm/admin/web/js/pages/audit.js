// The audit log, with filters kept in the address (so a filtered view can be shared).

import { api, describeError } from "../api.js";
import { field, h, replace } from "../dom.js";
import { ACTIONS, actionWords, dateTime, detailsText } from "../format.js";
import * as live from "../live.js";
import { auditActor, auditTarget, busy } from "./common.js";
import { timelineChart } from "../timeline.js";

const FILTERS = ["actor", "action", "deployment", "since", "until"];

/** A datetime-local value (the browser's local time) as epoch seconds for the API. */
function epoch(localValue) {
  if (!localValue) return undefined;
  const ms = new Date(localValue).getTime();
  return Number.isFinite(ms) ? String(ms / 1000) : undefined;
}

export function render({ query, navigate }) {
  const actor = field(
    "Actor",
    h("input", { type: "text", name: "actor", list: "audit-actors", value: query.get("actor") || "", spellcheck: "false" }),
    "Exact, e.g. admin:alice, ondemand, watchdog, system.",
  );
  const actorList = h("datalist#audit-actors", ["ondemand", "watchdog", "system", "litellm"].map((v) => h("option", { value: v })));
  const action = field(
    "Action",
    h("select", { name: "action" }, [
      h("option", { value: "" }, "Any action"),
      Object.entries(ACTIONS).map(([code, words]) =>
        h("option", { value: code, selected: query.get("action") === code }, `${words} (${code})`),
      ),
    ]),
  );
  const deployment = field(
    "Deployment",
    h("input", { type: "text", name: "deployment", list: "audit-deployments", value: query.get("deployment") || "", spellcheck: "false" }),
    "A name or id; removed deployments too.",
  );
  const depList = h("datalist#audit-deployments", live.deploymentsInOrder().map((d) => h("option", { value: d.name })));
  const since = field("From", h("input", { type: "datetime-local", name: "since", step: "1", value: query.get("since") || "" }));
  const until = field("Until", h("input", { type: "datetime-local", name: "until", step: "1", value: query.get("until") || "" }));
  const apply = h("button.primary", { type: "submit" }, "Apply filters");
  const clear = h("button.secondary", { type: "button" }, "Clear");
  const form = h("form.filters.card", { "aria-label": "Filters", id: "audit-filters" }, [
    actor.wrap,
    actorList,
    action.wrap,
    deployment.wrap,
    depList,
    since.wrap,
    until.wrap,
    h("div.actions", [apply, clear]),
  ]);
  const error = h("p.error", { role: "alert", hidden: true });
  const tbody = h("tbody");
  const count = h("p.muted", { role: "status" });
  const older = h("button.secondary", { type: "button", hidden: true }, "Show older entries");
  // The box over the filtered window (the last hour without one); its own picker moves it.
  const from = epoch(query.get("since"));
  const to = epoch(query.get("until"));
  const timeline = timelineChart({
    id: "audit-timeline",
    until: to ? Number(to) : null,
    since: from ? Number(from) : to ? Number(to) - 3600 : null,
  });
  const node = h("section", [
    h("h1", "Audit log"),
    form,
    timeline.node,
    error,
    count,
    h("div.table-wrap", h("table.audit", { id: "audit-table" }, [
      h("caption.visually-hidden", "Audit log, newest first"),
      h("thead", h("tr", ["Time", "Actor", "Action", "Deployment", "Details"].map((t) => h("th", { scope: "col" }, t)))),
      tbody,
    ])),
    older,
  ]);

  form.addEventListener("submit", (event) => {
    event.preventDefault();
    const params = new URLSearchParams();
    const values = {
      actor: actor.control.value.trim(),
      action: action.control.value,
      deployment: deployment.control.value.trim(),
      since: since.control.value,
      until: until.control.value,
    };
    for (const k of FILTERS) if (values[k]) params.set(k, values[k]);
    const qs = params.toString();
    navigate(`#/audit${qs ? `?${qs}` : ""}`);
  });
  clear.addEventListener("click", () => navigate("#/audit"));

  let rows = [];
  let nextBefore = null;
  function filterQuery() {
    return {
      actor: query.get("actor") || undefined,
      action: query.get("action") || undefined,
      deployment: query.get("deployment") || undefined,
      since: epoch(query.get("since")),
      until: epoch(query.get("until")),
    };
  }
  function row(r) {
    return h("tr", [
      h("td", h("time", { datetime: r.time || new Date(r.ts * 1000).toISOString() }, dateTime(r.ts))),
      h("td", auditActor(r)),
      h("td", [actionWords(r), h("span.sub", h("code", r.action))]),
      h("td", auditTarget(r)),
      h("td.details", detailsText(r.details)),
    ]);
  }
  async function load(more = false) {
    try {
      const data = await api("GET", "audit", { query: { ...filterQuery(), limit: 100, before: more ? nextBefore : undefined } });
      rows = more ? [...rows, ...data.rows] : data.rows;
      nextBefore = data.next_before;
      replace(tbody, rows.length ? rows.map(row) : h("tr", h("td", { colspan: "5" }, "No entries match.")));
      const filtered = FILTERS.some((k) => query.get(k));
      count.textContent = `${rows.length}${nextBefore ? "+" : ""} entr${rows.length === 1 ? "y" : "ies"}${filtered ? " match the filters" : ""}.`;
      older.hidden = !nextBefore;
      error.hidden = true;
    } catch (err) {
      error.textContent = describeError(err);
      error.hidden = false;
    }
  }
  older.addEventListener("click", () => busy(older, "Loading…", () => load(true)));
  load();
  return { node, title: "Audit log", destroy: () => timeline.destroy() };
}
