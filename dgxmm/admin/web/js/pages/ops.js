// What operators watch: the engine log (live), a start's progress, and the queue.
// Each builder returns { node, update?, destroy } and cleans up its timers and streams.

import { api, apiUrl, describeError } from "../api.js";
import { h, replace } from "../dom.js";
import { dateTime } from "../format.js";
import * as live from "../live.js";
import { throttle } from "./common.js";

const MAX_LOG_LINES = 2000; // lines kept on the page; older ones scroll away
const LOG_TAIL = 200;

/** "45 s", "3 min", "2 h". */
export function duration(seconds) {
  const s = Math.max(0, Number(seconds) || 0);
  if (s < 90) return `${Math.round(s)} s`;
  if (s < 90 * 60) return `${Math.round(s / 60)} min`;
  return `${Math.round(s / 3600)} h`;
}

/** The Logs tab: the engine's last lines, then every new one, across engine restarts. */
export function logsPanel(deploymentId) {
  const status = h("p.hint", { id: "log-status", role: "status" }, "Connecting…");
  const lines = h("pre.log", { id: "log-lines", role: "log", "aria-live": "off", tabindex: "0" });
  const follow = h("input", { type: "checkbox", id: "log-follow", checked: true });
  const node = h("section.card.logs-card", { "aria-labelledby": "logs-title" }, [
    h("div.card-head", [
      h("h2#logs-title", "Engine log"),
      h("div.radio", [follow, h("label", { for: follow.id }, "Scroll with new lines")]),
    ]),
    status,
    lines,
  ]);
  let count = 0;
  const url = apiUrl(`deployments/${encodeURIComponent(deploymentId)}/logs`, { tail: LOG_TAIL, follow: 1 });
  const source = new EventSource(url, { withCredentials: true });
  source.addEventListener("open", () => {
    // Every (re)connection starts with the last lines again: show them once.
    lines.replaceChildren();
    count = 0;
    status.textContent = "Following the engine's log live.";
  });
  source.addEventListener("line", (e) => {
    let text;
    try {
      text = JSON.parse(e.data);
    } catch {
      return;
    }
    lines.append(document.createTextNode(`${text}\n`));
    count += 1;
    while (count > MAX_LOG_LINES && lines.firstChild) {
      lines.firstChild.remove();
      count -= 1;
    }
    if (follow.checked) lines.scrollTop = lines.scrollHeight;
  });
  source.addEventListener("error", () => {
    status.textContent = source.readyState === EventSource.CLOSED ? "The log stream ended." : "Reconnecting…";
  });
  return { node, destroy: () => source.close() };
}

/** While a deployment starts: elapsed time against its last cold start, and the last log line. */
export function startProgress(deploymentId) {
  const node = h("div.progress", { id: "start-progress", role: "status", hidden: true });
  let timer = null;
  let stopped = false;

  async function poll() {
    timer = null;
    if (stopped) return;
    try {
      const p = await api("GET", `deployments/${encodeURIComponent(deploymentId)}/progress`);
      if (stopped) return;
      if (p.starting) {
        const against = p.last_cold_start_s != null ? ` (last cold start took ${duration(p.last_cold_start_s)})` : " (no earlier start to compare)";
        replace(node, [
          h("strong", `Starting for ${duration(p.elapsed_s)}`),
          against,
          p.expected_start_s != null ? h("span#start-estimate", ` · expected ${phaseSeconds(p.expected_start_s)} (est.)`) : null,
          startPhases(p.phases, p.in_phase_s),
          p.last_log_line ? h("span.last-line", [" · engine: ", h("code", p.last_log_line)]) : null,
        ]);
        node.hidden = false;
        timer = setTimeout(poll, 1000);
        return;
      }
      node.hidden = true;
    } catch {
      node.hidden = true;
    }
  }

  return {
    node,
    update(rec) {
      if (rec.state === "starting") {
        if (timer === null) poll();
      } else {
        node.hidden = true;
      }
    },
    destroy() {
      stopped = true;
      if (timer !== null) clearTimeout(timer);
    },
  };
}

/** "0.42 s", "31.2 s", "1 min 32 s": a phase's length, finer than `duration`. */
function phaseSeconds(seconds) {
  const s = Math.max(0, Number(seconds) || 0);
  if (s < 1) return `${s.toFixed(2)} s`;
  if (s < 90) return `${s.toFixed(1)} s`;
  return `${Math.floor(s / 60)} min ${Math.round(s % 60)} s`;
}

/** A start's phases so far, then the one under way. */
function startPhases(phases, inPhase) {
  if (!phases || !phases.length) return null;
  return h("ol.start-phases#start-phases", [
    ...phases.map((ph) =>
      h("li", { "data-phase": ph.name, title: ph.detail || null }, `${ph.name.replaceAll("_", " ")} ${phaseSeconds(ph.seconds)}`),
    ),
    inPhase != null ? h("li.current", `… ${phaseSeconds(inPhase)} so far`) : null,
  ]);
}

/** The Queue panel: each waiting request, and what it waits for. */
export function queuePanel({ deploymentId = null } = {}) {
  const body = h("div", { id: "queue-panel-body" }, h("p.muted", "Loading…"));
  const error = h("p.error", { role: "alert", hidden: true });
  const node = h("section.card.queue-card", { id: "queue-panel", "aria-labelledby": "queue-title" }, [
    h("h2#queue-title", "Queue"),
    error,
    body,
  ]);
  let stopped = false;

  async function load() {
    try {
      const data = await api("GET", "queue");
      if (stopped) return;
      error.hidden = true;
      const rows = deploymentId ? data.requests.filter((r) => r.deployment_id === deploymentId) : data.requests;
      if (!rows.length) {
        replace(body, h("p.muted", { id: "queue-empty" }, "No request is waiting."));
        return;
      }
      replace(
        body,
        h("table.queue", { id: "queue-table" }, [
          h("caption.visually-hidden", "Waiting requests, oldest first"),
          h(
            "thead",
            h("tr", ["#", "Model", "Waiting", "Gives up", "Start (est.)", "Waits for"].map((t) => h("th", { scope: "col" }, t))),
          ),
          h(
            "tbody",
            rows.map((r) =>
              h("tr", { "data-request-id": r.request_id }, [
                h("td", String(r.position)),
                h("td", [h("a", { href: `#/deployments/${encodeURIComponent(r.deployment_id)}` }, r.deployment), h("div.hint", r.model)]),
                h("td", duration(r.age_s)),
                h("td", { title: dateTime(r.deadline_at) }, `in ${duration(r.deadline_in_s)}`),
                h("td.estimate", r.expected_start_s != null ? `est. ${phaseSeconds(r.expected_start_s)}` : "–"),
                h("td.reason", r.reason),
              ]),
            ),
          ),
        ]),
      );
    } catch (err) {
      if (stopped) return;
      error.textContent = describeError(err);
      error.hidden = false;
    }
  }

  const reload = throttle(load, 1000);
  const unsubscribe = live.subscribe((kind) => {
    if (kind === "queue" || kind === "snapshot" || kind === "deployment" || kind === "memory") reload();
  });
  const ticker = setInterval(load, 5000); // ages and deadlines move on their own
  load();
  return {
    node,
    destroy() {
      stopped = true;
      unsubscribe();
      reload.cancel();
      clearInterval(ticker);
    },
  };
}
