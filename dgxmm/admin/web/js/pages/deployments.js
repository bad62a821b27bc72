// The deployments table, kept live by the event stream.

import { describeError } from "../api.js";
import { h, replace } from "../dom.js";
import { badge, engineName, gib, minutes, modeLabel, relativeTime } from "../format.js";
import * as live from "../live.js";

function modeCell(rec) {
  if (rec.pending_mode === "always_on") return [modeLabel(rec.mode), h("span.sub", "Switching to always on")];
  if (rec.mode === "on_demand") return [modeLabel(rec.mode), h("span.sub", `sleeps after ${minutes(rec.effective_idle_timeout_s)} min idle`)];
  return [rec.role === "decision" ? "Always on (decision model)" : modeLabel(rec.mode)];
}

function inFlightCell(rec) {
  const waiting = rec.queued + rec.waiting_for_start;
  return [String(rec.in_flight), waiting > 0 ? h("span.sub", `${waiting} waiting`) : null];
}

function row(rec) {
  const tr = h("tr", { "data-id": rec.id, "data-name": rec.name }, [
    h("th", { scope: "row" }, h("a", { href: `#/deployments/${encodeURIComponent(rec.id)}` }, rec.name)),
    h("td.engine"),
    h("td.mode"),
    h("td.status"),
    h("td.num.inflight"),
    h("td.num.memory"),
    h("td.lastused"),
  ]);
  return fill(tr, rec);
}

/** Update the cells in place, so a focused link in the row keeps its focus. */
function fill(tr, rec) {
  const [, engine, mode, status, inflight, memory, lastUsed] = tr.children;
  replace(engine, engineName(rec.engine), h("span.sub", rec.model));
  replace(mode, ...modeCell(rec));
  if (status.textContent !== rec.badge) replace(status, badge(rec.badge));
  replace(inflight, ...inFlightCell(rec));
  replace(memory, gib(rec.memory_bytes));
  replace(lastUsed, relativeTime(rec.last_used_at));
  return tr;
}

export function render({ isAdmin }) {
  const tbody = h("tbody");
  const empty = h("p.empty", { hidden: true }, [
    "No deployments yet.",
    isAdmin ? [" ", h("a", { href: "#/deploy" }, "Deploy a model")] : null,
  ]);
  const error = h("p.error", { role: "alert", hidden: true });
  const table = h("table.deployments", { id: "deployments-table" }, [
    h("caption.visually-hidden", "Deployments, updated live"),
    h(
      "thead",
      h("tr", ["Name", "Engine and model", "Mode", "Status", "In flight", "Memory", "Last used"].map((t) =>
        h("th", { scope: "col", class: t === "In flight" || t === "Memory" ? "num" : null }, t),
      )),
    ),
    tbody,
  ]);
  const node = h("section", [
    h("div.page-head", [
      h("h1", "Deployments"),
      isAdmin ? h("a.button.primary", { href: "#/deploy", id: "deploy-link" }, "Deploy a model") : null,
    ]),
    error,
    h("div.table-wrap", table),
    empty,
  ]);

  const rows = new Map();
  function upsert(rec) {
    const old = rows.get(rec.id);
    if (old) {
      fill(old, rec);
      return;
    }
    const fresh = row(rec);
    tbody.append(fresh);
    rows.set(rec.id, fresh);
  }
  function drawAll() {
    rows.clear();
    replace(tbody);
    for (const rec of live.deploymentsInOrder()) upsert(rec);
    empty.hidden = !live.state.loaded || rows.size > 0;
  }
  const unsubscribe = live.subscribe((kind, payload) => {
    if (kind === "snapshot") drawAll();
    else if (kind === "deployment") {
      upsert(payload);
      empty.hidden = true;
    } else if (kind === "removed") {
      const old = rows.get(payload.id);
      if (old) old.remove();
      rows.delete(payload.id);
      empty.hidden = rows.size > 0;
    }
  });
  drawAll();
  if (!live.state.loaded) {
    live.refreshDeployments().catch((err) => {
      error.textContent = describeError(err);
      error.hidden = false;
    });
  }
  return { node, title: "Deployments", destroy: unsubscribe };
}
