// Dashboard: the memory budget, how many deployments show each badge, recent events.

import { api, describeError } from "../api.js";
import { h, replace } from "../dom.js";
import { actionWords, badge, badgeKind, gib, relativeTime } from "../format.js";
import * as live from "../live.js";
import { auditActor, auditTarget, loggedChange, throttle } from "./common.js";
import { queuePanel } from "./ops.js";
import { timelineChart } from "../timeline.js";

const BADGE_ORDER = ["ready", "starting", "queued", "sleeping", "neutral", "failed"];

export function render() {
  const memoryBody = h("div", { id: "memory" }, h("p.muted", "Loading…"));
  const countsBody = h("div", { id: "badge-counts" }, h("p.muted", "Loading…"));
  const eventsBody = h("div", { id: "recent-events" }, h("p.muted", "Loading…"));
  const queue = queuePanel();
  const timeline = timelineChart({ live: true, id: "dashboard-timeline" });
  const node = h("section.dashboard", [
    h("h1", "Dashboard"),
    h("div.grid", [
      h("section.card", { "aria-labelledby": "mem-title" }, [h("h2#mem-title", "Memory"), memoryBody]),
      h("section.card", { "aria-labelledby": "counts-title" }, [
        h("h2#counts-title", "Deployments"),
        countsBody,
      ]),
    ]),
    timeline.node,
    queue.node,
    h("section.card", { "aria-labelledby": "events-title" }, [h("h2#events-title", "Recent events"), eventsBody]),
  ]);

  function drawMemory() {
    const mem = live.state.memory;
    if (!mem) return;
    const usable = mem.usable_bytes || 0;
    const pct = (b) => (usable > 0 ? `${Math.min(100, (100 * b) / usable).toFixed(2)}%` : "0%");
    const row = (cls, label, bytes) =>
      h("div.mem-row", [h(`span.swatch.${cls}`, { "aria-hidden": "true" }), h("dt", label), h("dd", gib(bytes))]);
    replace(
      memoryBody,
      h(
        "div.membar",
        {
          role: "img",
          "aria-label": `Always on ${gib(mem.always_on_bytes)}, on demand ${gib(mem.on_demand_bytes)}, free ${gib(mem.free_bytes)} of ${gib(usable)} usable`,
        },
        [
          h("span.seg.always", { style: `width:${pct(mem.always_on_bytes)}` }),
          h("span.seg.ondemand", { style: `width:${pct(mem.on_demand_bytes)}` }),
        ],
      ),
      h("dl.memlist", [
        row("always", "Always on", mem.always_on_bytes),
        row("ondemand", "On demand", mem.on_demand_bytes),
        row("free", "Free", mem.free_bytes),
        h("div.mem-row.total", [h("span.swatch", { "aria-hidden": "true" }), h("dt", "Usable"), h("dd", gib(usable))]),
      ]),
      mem.total_bytes && mem.total_bytes !== usable
        ? h("p.hint", `${gib(mem.total_bytes)} in the machine; the rest is kept for the system.`)
        : null,
    );
  }

  function drawCounts() {
    if (!live.state.loaded) return;
    const deps = live.deploymentsInOrder();
    if (deps.length === 0) {
      replace(countsBody, h("p", ["No deployments yet. ", h("a", { href: "#/deploy" }, "Deploy a model")]));
      return;
    }
    const counts = new Map();
    for (const d of deps) counts.set(d.badge, (counts.get(d.badge) || 0) + 1);
    const entries = [...counts.entries()].sort(
      (a, b) => BADGE_ORDER.indexOf(badgeKind(a[0])) - BADGE_ORDER.indexOf(badgeKind(b[0])) || a[0].localeCompare(b[0]),
    );
    const inFlight = deps.reduce((n, d) => n + d.in_flight, 0);
    const waiting = deps.reduce((n, d) => n + d.queued + d.waiting_for_start, 0);
    replace(
      countsBody,
      h(
        "ul.counts",
        entries.map(([text, n]) => h("li", { "data-count-for": text }, [h("span.count", String(n)), " ", badge(text)])),
      ),
      h("p", [
        h("a", { href: "#/deployments" }, `${deps.length} deployment${deps.length === 1 ? "" : "s"}`),
        ` · ${inFlight} request${inFlight === 1 ? "" : "s"} in flight · ${waiting} waiting`,
      ]),
    );
  }

  let eventsBusy = false;
  async function loadEvents() {
    if (eventsBusy) return;
    eventsBusy = true;
    try {
      const data = await api("GET", "audit", { query: { limit: 10 } });
      const rows = (data.rows || []).slice(0, 10); // newest first
      if (rows.length === 0) {
        replace(eventsBody, h("p.muted", "Nothing has happened yet."));
        return;
      }
      replace(
        eventsBody,
        h("table.events", [
          h("caption.visually-hidden", "The ten most recent events"),
          h("thead", h("tr", [h("th", { scope: "col" }, "When"), h("th", { scope: "col" }, "What"), h("th", { scope: "col" }, "Deployment"), h("th", { scope: "col" }, "By")])),
          h(
            "tbody",
            rows.map((r) =>
              h("tr", [h("td", relativeTime(r.ts)), h("td", actionWords(r)), h("td", auditTarget(r)), h("td", auditActor(r))]),
            ),
          ),
        ]),
        h("p", h("a", { href: "#/audit" }, "Full audit log")),
      );
    } catch (err) {
      replace(eventsBody, h("p.error", describeError(err)));
    } finally {
      eventsBusy = false;
    }
  }
  const loadEventsSoon = throttle(loadEvents, 3000);
  const seen = new Map(live.deploymentsInOrder().map((d) => [d.id, d]));

  const unsubscribe = live.subscribe((kind, payload) => {
    if (kind === "memory" || kind === "snapshot") drawMemory();
    if (kind === "deployment" || kind === "removed" || kind === "snapshot") drawCounts();
    // The audit log is read again only when something it records may have happened.
    if (kind === "deployment") {
      if (loggedChange(seen.get(payload.id), payload)) loadEventsSoon();
      seen.set(payload.id, payload);
    } else if (kind === "removed") {
      seen.delete(payload.id);
      loadEventsSoon();
    }
  });
  drawMemory();
  drawCounts();
  if (!live.state.memory) {
    api("GET", "memory")
      .then((mem) => {
        if (!live.state.memory) {
          live.state.memory = mem;
          drawMemory();
        }
      })
      .catch((err) => replace(memoryBody, h("p.error", describeError(err))));
  }
  if (!live.state.loaded) live.refreshDeployments().catch((err) => replace(countsBody, h("p.error", describeError(err))));
  loadEvents();
  return { node, title: "Dashboard", destroy: () => { unsubscribe(); loadEventsSoon.cancel(); queue.destroy(); timeline.destroy(); } };
}
