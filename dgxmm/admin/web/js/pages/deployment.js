// One deployment: Overview (status, start progress, the Mode card, actions, its queue), the
// Events tab and the Logs tab.

import { api, describeError } from "../api.js";
import { append, field, h, replace } from "../dom.js";
import {
  badge,
  dateTime,
  engineName,
  gib,
  makeRoomText,
  minutes,
  modeLabel,
  modeSummary,
  quoteArgs,
  relativeTime,
} from "../format.js";
import * as live from "../live.js";
import { busy, dialog, loggedChange, throttle } from "./common.js";
import { logsPanel, queuePanel, startProgress } from "./ops.js";
import { idleSeconds, makeRoomSeconds } from "./wizard.js";
import { timelineChart } from "../timeline.js";

const POLICY_WORDS = { seed: "Seed's rules (idle timeout)", learned: "Learned from its traffic" };
const STATE_WORDS = {
  stopped: "Stopped",
  starting: "Starting",
  ready: "Ready",
  stopping: "Stopping",
  failed: "Failed",
  asleep: "Asleep (engine sleep mode)",
};

function findRecord(key) {
  return live.state.deployments.get(key) || [...live.state.deployments.values()].find((d) => d.name === key) || null;
}

export function render({ params, isAdmin, navigate, notify }) {
  const key = decodeURIComponent(params[0]);
  const tab = params[1] === "events" || params[1] === "logs" ? params[1] : "overview";
  let rec = findRecord(key);

  const title = h("h1", rec ? rec.name : key);
  const crumb = h("span", rec ? rec.name : key); // the name once the record is known
  const headBadge = h("span.head-badge", { id: "deployment-badge" });
  const subtitle = h("p.subtitle");
  const pageError = h("p.error", { role: "alert", id: "page-error", hidden: true });
  const panel = h("div.panel", { id: `panel-${tab}` });
  const tabs = h("nav.tabs", { "aria-label": "Deployment sections" });
  const actionsBar = h("div.toolbar", { role: "group", "aria-label": "Actions" });
  const removedNote = h("div.card.notice-card", { role: "status", hidden: true }, [
    h("p", "This deployment was removed."),
    h("p", h("a", { href: "#/deployments" }, "Back to the deployments")),
  ]);
  const node = h("section.deployment", [
    h("p.crumbs", [h("a", { href: "#/deployments" }, "Deployments"), " / ", crumb]),
    h("div.page-head", [h("div.title-row", [title, headBadge]), actionsBar]),
    subtitle,
    pageError,
    removedNote,
    tabs,
    panel,
  ]);

  function depPath(suffix = "") {
    return `deployments/${encodeURIComponent(rec ? rec.id : key)}${suffix}`;
  }

  function showError(err) {
    pageError.textContent = describeError(err);
    pageError.hidden = false;
  }

  // --- actions -------------------------------------------------------------------
  const startBtn = h("button.primary", { type: "button", id: "action-start" }, "Start");
  const stopBtn = h("button.secondary", { type: "button", id: "action-stop" }, "Stop");
  const switchBtn = h("button.secondary", { type: "button", id: "action-switch" }, "Switch model…");
  const removeBtn = h("button.danger", { type: "button", id: "action-remove" }, "Remove");
  if (isAdmin) actionsBar.append(startBtn, stopBtn, switchBtn, removeBtn);

  async function doStart(button) {
    await busy(button, "Starting…", async () => {
      const updated = await api("POST", depPath("/start"));
      live.putDeployment(updated);
      notify(`${updated.name} is starting.`);
    }, pageError);
  }
  startBtn.addEventListener("click", () => doStart(startBtn));

  stopBtn.addEventListener("click", async () => {
    const busyNow = rec.in_flight + rec.queued + rec.waiting_for_start;
    if (busyNow > 0) {
      const ok = await dialog({
        title: `Stop ${rec.name}?`,
        body: h("p", `${busyNow} request${busyNow === 1 ? " is" : "s are"} being answered or waiting for it. Stopping cuts ${busyNow === 1 ? "it" : "them"} off.`),
        submitText: "Stop",
        danger: true,
        onSubmit: async () => true,
      });
      if (!ok) return;
    }
    await busy(stopBtn, "Stopping…", async () => {
      const updated = await api("POST", depPath("/stop"));
      live.putDeployment(updated);
      notify(`${updated.name} is stopping.`);
    }, pageError);
  });

  switchBtn.addEventListener("click", async () => {
    const model = field("Model", h("input", { type: "text", value: rec.model, required: true, spellcheck: "false" }));
    const memory = field(
      "Memory (GiB)",
      h("input", { type: "number", min: "0.1", step: "0.1", value: String(rec.memory_gib ?? rec.memory_bytes / 1024 ** 3) }),
      "Leave as is to keep the current memory.",
    );
    const result = await dialog({
      title: `Switch the model of ${rec.name}`,
      body: h("div", [
        h("p.hint", `The deployment keeps its name and its mode (${modeLabel(rec.mode).toLowerCase()}); the engine restarts with the new model.`),
        model.wrap,
        memory.wrap,
      ]),
      submitText: "Switch model",
      onSubmit: async () => {
        const m = model.control.value.trim();
        if (!m) throw new Error("Model: enter what the engine should load");
        const body = { model: m };
        const mem = Number(memory.control.value);
        if (!Number.isFinite(mem) || mem <= 0) throw new Error("Memory: more than 0 GiB");
        if (Math.abs(mem * 1024 ** 3 - rec.memory_bytes) > 1024 ** 2) body.memory_gib = mem;
        return api("POST", depPath("/switch-model"), { body });
      },
    });
    if (result) {
      live.putDeployment(result);
      notify(`${result.name} now runs ${result.model}.`);
    }
  });

  removeBtn.addEventListener("click", async () => {
    const result = await dialog({
      title: `Remove ${rec.name}?`,
      body: h("p", "It is stopped, its memory is freed and it disappears from LiteLLM. Its history stays in the audit log."),
      submitText: "Remove",
      danger: true,
      onSubmit: () => api("DELETE", depPath()),
    });
    if (result) {
      live.dropDeployment(rec.id);
      notify(`${rec.name} was removed.`);
      navigate("#/deployments");
    }
  });

  function drawActions() {
    if (!isAdmin || !rec) return;
    // A failed deployment offers Start in the card that says why it failed.
    startBtn.hidden = !["stopped", "stopping"].includes(rec.state);
    stopBtn.hidden = !["starting", "ready", "asleep"].includes(rec.state);
  }

  // --- header and tabs -----------------------------------------------------------------
  function drawHead() {
    title.textContent = crumb.textContent = rec.name;
    if (headBadge.textContent !== rec.badge) replace(headBadge, badge(rec.badge));
    subtitle.textContent = `${engineName(rec.engine)} · ${rec.model} · ${modeSummary(rec)}`;
  }
  const tabLink = (id, text, href) =>
    h("a", { href, id: `tab-${id}`, class: tab === id ? "active" : "", "aria-current": tab === id ? "page" : null }, text);

  function drawTabs() {
    const base = `#/deployments/${encodeURIComponent(rec ? rec.id : key)}`;
    replace(
      tabs,
      tabLink("overview", "Overview", base),
      tabLink("events", "Events", `${base}/events`),
      tabLink("logs", "Logs", `${base}/logs`),
    );
  }

  // --- overview --------------------------------------------------------------------------
  const failedBox = h("section.card.failed-card", { id: "failed-card", hidden: true, role: "alert" });
  const failedReason = h("p.reason");
  const failedRetry = h("p.hint");
  const failedStart = h("button.primary", { type: "button", id: "failed-start" }, "Start");
  failedStart.addEventListener("click", () => doStart(failedStart));
  append(failedBox, [h("h2", "The deployment failed"), failedReason, failedRetry, isAdmin ? h("div.actions", failedStart) : h("p.hint", "An administrator can start it again.")]);
  const statusBody = h("dl.facts", { id: "status-facts" });
  const statusCard = h("section.card", { "aria-labelledby": "status-title" }, [h("h2#status-title", "Status"), statusBody]);
  const modeCard = buildModeCard();
  const progress = tab === "overview" ? startProgress(rec ? rec.id : key) : null;
  const notStarted = h("section.card.failed-card", { id: "not-started-card", hidden: true, role: "alert" });
  const queue = tab === "overview" ? queuePanel({ deploymentId: rec ? rec.id : key }) : null;
  const logs = tab === "logs" ? logsPanel(rec ? rec.id : key) : null;
  // The Events tab: the box over a window the operator picks, this deployment's lane in front.
  const timeline = tab === "events" ? timelineChart({ id: "events-timeline", focus: rec ? rec.id : key }) : null;

  function drawOverview() {
    if (progress) progress.update(rec);
    // On demand, a model that did not fit simply starts on its next request: no alarm, and
    // nothing at all once a request waits for it (the queue panel says what it waits for).
    const onDemand = rec.mode === "on_demand";
    notStarted.hidden = !rec.not_started || (onDemand && (rec.state !== "stopped" || rec.queued > 0 || rec.waiting_for_start > 0));
    notStarted.className = onDemand ? "card" : "card failed-card";
    notStarted.setAttribute("role", onDemand ? "status" : "alert");
    if (rec.not_started) {
      replace(notStarted, onDemand
        ? [
            h("h2", "Not started yet"),
            h("p.reason", `Why: ${rec.not_started}`),
            h("p.hint", "On demand, it starts on its next request, making room then if it can."),
          ]
        : [
            h("h2", "Not started"),
            h("p.reason", `Why: ${rec.not_started}`),
            h("p.hint", "Free memory (stop or shrink another deployment), then start it."),
          ]);
    }
    failedBox.hidden = rec.state !== "failed";
    failedReason.textContent = rec.last_error ? `Why: ${rec.last_error}` : "It did not say why.";
    failedRetry.textContent =
      rec.retry_at && rec.mode === "on_demand"
        ? `A request starts it again no sooner than ${dateTime(rec.retry_at)}; Start tries now.`
        : "It is removed from LiteLLM until it is started again.";
    const facts = [
      ["Status", badge(rec.badge)],
      ["Requests in flight", String(rec.in_flight)],
      ["Waiting for it to start", String(rec.waiting_for_start)],
      ["Queued for memory", String(rec.queued)],
      ["Memory", gib(rec.memory_bytes)],
      ["Last used", relativeTime(rec.last_used_at)],
      ["Engine", engineName(rec.engine)],
      ["Model", rec.model],
      ["Engine arguments", rec.args && rec.args.length ? h("code", quoteArgs(rec.args)) : "none"],
      ["Engine address", rec.engine_url || "not running"],
      ["Start failures in a row", String(rec.failures)],
      ["Created", dateTime(rec.created_at)],
    ];
    if (rec.state === "failed" || rec.last_error) facts.splice(1, 0, ["Last error", rec.last_error || "—"]);
    replace(statusBody, facts.map(([k, v]) => h("div", [h("dt", k), h("dd", v)])));
    if (modeCard) modeCard.update();
    const stopHint = panel.querySelector("#stop-hint");
    if (stopHint) stopHint.hidden = rec.mode !== "on_demand";
  }

  // ondemand_policy (issue 44): how an on-demand model is kept warm, and what the learned
  // policy found in its traffic (rec.learned, in words).
  function policyText(value) {
    return POLICY_WORDS[value] || POLICY_WORDS.seed;
  }
  function ownPolicyText() {
    if (rec.ondemand_policy) return policyText(rec.ondemand_policy);
    return `${policyText(rec.effective_ondemand_policy)} (the default)`;
  }
  function learnedText() {
    return rec.mode === "on_demand" && rec.learned ? `Learned: ${rec.learned}` : "";
  }

  function buildModeCard() {
    // The decision model has no Mode card: it is always on.
    const card = h("section.card.mode-card", { id: "mode-card", "aria-labelledby": "mode-title" });
    const pending = h("p.pending", { role: "status", id: "mode-pending", hidden: true }, "Switching to always on");
    const learned = h("p.hint", { id: "mode-learned", role: "status", hidden: true });
    const drawLearned = () => {
      learned.textContent = learnedText();
      learned.hidden = !learned.textContent;
    };
    if (!isAdmin) {
      const facts = h("dl.facts");
      append(card, [h("h2#mode-title", "Mode"), pending, facts, learned]);
      return {
        card,
        update() {
          card.hidden = rec.role === "decision";
          pending.hidden = rec.pending_mode !== "always_on";
          const rows = [["Mode", modeLabel(rec.mode)]];
          if (rec.mode === "on_demand") {
            rows.push([
              "Idle minutes before sleeping",
              rec.idle_timeout_s === null
                ? `${minutes(rec.effective_idle_timeout_s)} (the default)`
                : minutes(rec.idle_timeout_s),
            ]);
            rows.push([
              "Makes room for queued models",
              `${makeRoomText(rec.effective_make_room_after_s)}${rec.make_room_after_s === null ? " (the default)" : ""}`,
            ]);
            rows.push(["Kept warm by", ownPolicyText()]);
          }
          replace(facts, rows.map(([k, v]) => h("div", [h("dt", k), h("dd", v)])));
          drawLearned();
        },
      };
    }
    const onDemandText = h("span");
    const onDemand = h("input", { type: "radio", name: "mode-card-mode", value: "on_demand", id: "mode-ondemand" });
    const alwaysOn = h("input", { type: "radio", name: "mode-card-mode", value: "always_on", id: "mode-always" });
    const idle = h("input", { type: "number", id: "mode-idle", min: "1", max: "1440", step: "any", inputmode: "decimal" });
    const idleHint = h("p.hint", { id: "mode-idle-hint" });
    idle.setAttribute("aria-describedby", idleHint.id);
    const idleWrap = h("div.field", [h("label", { for: idle.id }, "Idle minutes before sleeping"), idle, idleHint]);
    const room = h("input", { type: "number", id: "mode-make-room", min: "0", max: "86400", step: "1", inputmode: "numeric" });
    const roomHint = h("p.hint", { id: "mode-make-room-hint" });
    room.setAttribute("aria-describedby", roomHint.id);
    const roomWrap = h("div.field", [h("label", { for: room.id }, "Make room after (seconds)"), room, roomHint]);
    const policyDefault = h("option", { value: "" }, "Default");
    const policy = h("select", { id: "mode-policy" }, [
      policyDefault,
      h("option", { value: "seed" }, POLICY_WORDS.seed),
      h("option", { value: "learned" }, POLICY_WORDS.learned),
    ]);
    const policyHint = h(
      "p.hint",
      { id: "mode-policy-hint" },
      "Learned: it stays warm through the gaps its own traffic usually has (the idle timeout the longest), and is started just before a request its history predicts. Default: the DGXMM default, set in Settings.",
    );
    policy.setAttribute("aria-describedby", policyHint.id);
    const policyWrap = h("div.field", [h("label", { for: policy.id }, "Kept warm by"), policy, policyHint]);
    const error = h("p.error", { role: "alert", hidden: true });
    const save = h("button.primary", { type: "submit", id: "mode-save" }, "Save mode");
    const form = h("form", { novalidate: true }, [
      h("fieldset.radios", [
        h("legend.visually-hidden", "Mode"),
        h("div.radio", [onDemand, h("label", { for: onDemand.id }, onDemandText)]),
        h("div.radio", [alwaysOn, h("label", { for: alwaysOn.id }, "Always on")]),
      ]),
      idleWrap,
      roomWrap,
      policyWrap,
      error,
      h("div.actions", save),
    ]);
    append(card, [h("h2#mode-title", "Mode"), pending, learned, form]);
    let dirty = false;

    function defaultMinutes() {
      const settings = live.state.settings;
      if (settings && settings.ondemand_idle_timeout_s) return minutes(settings.ondemand_idle_timeout_s);
      if (rec.idle_timeout_s === null) return minutes(rec.effective_idle_timeout_s);
      return null;
    }
    function drawLabels() {
      const typed = idle.value.trim() ? idleSeconds(idle.value) : null;
      const n = typed && !typed.error ? minutes(typed.seconds) : defaultMinutes() || minutes(rec.effective_idle_timeout_s);
      onDemandText.textContent = `On demand — start on the first request, sleep after ${n} min idle`;
      const def = defaultMinutes();
      idle.placeholder = def ? `default: ${def}` : "default";
      idleHint.textContent = `1 to 1440. Leave it empty for the default${def ? ` (${def} min)` : ""}, which follows later changes in Settings.`;
      idleWrap.hidden = !onDemand.checked;
      const settings = live.state.settings;
      const roomDefault = settings ? ` (${makeRoomText(settings.ondemand_make_room_after_s ?? null)})` : "";
      room.placeholder = "default";
      roomHint.textContent = `0 to 86400: how long without a request before it may sleep so a queued model can start. Empty: the DGXMM default${roomDefault}, set in Settings.`;
      roomWrap.hidden = !onDemand.checked;
      // The DGXMM default: from the settings, else what this deployment follows by default.
      const byDefault = (settings && settings.ondemand_policy) || (rec.ondemand_policy ? null : rec.effective_ondemand_policy);
      policyDefault.textContent = byDefault ? `Default (${policyText(byDefault)})` : "Default";
      policyWrap.hidden = !onDemand.checked;
      drawLearned();
    }
    function fill() {
      onDemand.checked = rec.mode === "on_demand";
      alwaysOn.checked = rec.mode !== "on_demand";
      idle.value = rec.idle_timeout_s === null ? "" : minutes(rec.idle_timeout_s);
      room.value = rec.make_room_after_s === null || rec.make_room_after_s === undefined ? "" : String(rec.make_room_after_s);
      policy.value = rec.ondemand_policy || "";
      dirty = false;
    }
    const markDirty = () => {
      dirty = true;
      drawLabels();
    };
    for (const el of [onDemand, alwaysOn]) el.addEventListener("change", markDirty);
    idle.addEventListener("input", markDirty);
    room.addEventListener("input", markDirty);
    policy.addEventListener("change", markDirty);
    form.addEventListener("submit", async (event) => {
      event.preventDefault();
      error.hidden = true;
      idle.removeAttribute("aria-invalid");
      let body;
      if (onDemand.checked) {
        let seconds = null;
        const refuse = (control, message) => {
          error.textContent = message;
          error.hidden = false;
          control.setAttribute("aria-invalid", "true");
          control.focus();
        };
        if (idle.value.trim()) {
          const parsed = idleSeconds(idle.value);
          if (parsed.error) return refuse(idle, parsed.error);
          seconds = parsed.seconds;
        }
        const parsedRoom = makeRoomSeconds(room.value);
        if (parsedRoom.error) return refuse(room, parsedRoom.error);
        room.removeAttribute("aria-invalid");
        body = { mode: "on_demand", idle_timeout_s: seconds, make_room_after_s: parsedRoom.seconds, ondemand_policy: policy.value || null };
      } else {
        body = { mode: "always_on" };
      }
      const updated = await busy(save, "Saving…", () => api("PATCH", depPath("/mode"), { body }), error);
      if (updated) {
        rec = updated;
        live.putDeployment(updated);
        fill();
        drawLabels();
        notify(updated.pending_mode === "always_on" ? `${updated.name} is starting; then it becomes always on.` : "Mode saved.");
      }
    });
    if (rec) fill();
    return {
      card,
      update() {
        card.hidden = rec.role === "decision";
        pending.hidden = rec.pending_mode !== "always_on";
        if (!dirty) fill();
        drawLabels();
      },
    };
  }

  // --- events tab ------------------------------------------------------------------------
  // A start's list: Started, Loading, each loading milestone, Ready. A milestone whose line
  // was read just after the engine answered ready is recorded after Ready, but it happened
  // before: it is listed under Ready, at Ready's time (its event's `at`), see inStartOrder.
  const eventsBody = h("tbody");
  const eventsError = h("p.error", { role: "alert", hidden: true });
  const olderBtn = h("button.secondary", { type: "button", hidden: true }, "Show older events");
  let nextBefore = null;
  let loadedRows = [];

  function eventRow(e) {
    return h("tr", [
      h("td", h("time", { datetime: new Date(e.ts * 1000).toISOString() }, dateTime(e.ts))),
      h("td.title", e.title),
      h("td", e.actor),
    ]);
  }
  async function loadEvents({ older = false } = {}) {
    try {
      const data = await api("GET", depPath("/events"), { query: { limit: 100, before: older ? nextBefore : undefined } });
      loadedRows = older ? [...loadedRows, ...data.events] : data.events;
      if (!older) nextBefore = data.next_before;
      else nextBefore = data.next_before;
      replace(
        eventsBody,
        loadedRows.length ? inStartOrder(loadedRows).map(eventRow) : h("tr", h("td", { colspan: "3" }, "No events yet.")),
      );
      olderBtn.hidden = nextBefore === null || nextBefore === undefined;
      eventsError.hidden = true;
    } catch (err) {
      eventsError.textContent = describeError(err);
      eventsError.hidden = false;
    }
  }
  olderBtn.addEventListener("click", () => busy(olderBtn, "Loading…", () => loadEvents({ older: true })));
  const reloadEventsSoon = throttle(() => {
    if (loadedRows.length <= 100) loadEvents();
  }, 1500);

  // --- assembling ------------------------------------------------------------------------
  function drawAll() {
    if (!rec) return;
    drawHead();
    drawActions();
    if (tab === "overview") drawOverview();
  }

  if (tab === "overview") {
    append(panel, [
      progress.node,
      notStarted,
      failedBox,
      h("div.grid", [statusCard, modeCard ? modeCard.card : null]),
      queue.node,
    ]);
    if (isAdmin) {
      panel.append(
        h("p.hint", { id: "stop-hint", hidden: true }, "Stop on an on-demand deployment puts it to sleep: the next request starts it again. To keep it down, switch it to always on first, then stop it."),
      );
    }
  } else if (tab === "logs") {
    append(panel, [logs.node]);
  } else {
    append(panel, [
      timeline.node,
      h("table.events", { id: "events-table" }, [
        h("caption.visually-hidden", "Events, newest first"),
        h("thead", h("tr", [h("th", { scope: "col" }, "Time"), h("th", { scope: "col" }, "Event"), h("th", { scope: "col" }, "By")])),
        eventsBody,
      ]),
      eventsError,
      olderBtn,
    ]);
    loadEvents();
  }

  const unsubscribe = live.subscribe((kind, payload) => {
    if (kind === "removed" && rec && payload.id === rec.id) {
      removedNote.hidden = false;
      actionsBar.hidden = true;
      panel.hidden = true;
      return;
    }
    const fresh = kind === "snapshot" || kind === "deployment" ? findRecord(rec ? rec.id : key) : null;
    if (fresh) {
      const before = rec;
      rec = fresh;
      drawAll();
      drawTabs();
      if (tab === "events" && loggedChange(before, fresh)) reloadEventsSoon();
    } else if (kind === "settings" && rec && tab === "overview") {
      drawOverview();
    }
  });

  drawTabs();
  if (rec) {
    drawAll();
  } else {
    panel.hidden = true;
    api("GET", `deployments/${encodeURIComponent(key)}`)
      .then((r) => {
        rec = r;
        panel.hidden = false;
        drawTabs();
        drawAll();
      })
      .catch((err) => {
        showError(err);
        actionsBar.hidden = true;
      });
  }
  return {
    node,
    title: rec ? rec.name : "Deployment",
    destroy() {
      unsubscribe();
      reloadEventsSoon.cancel();
      for (const part of [progress, queue, logs, timeline]) if (part) part.destroy();
    },
  };
}

/** The Events tab's rows (newest first) in the order things happened: the loading milestones
 * recorded after a Ready (their lines were read a moment after the engine answered) go under
 * it, at its time, which is what their events' `at` says (never later than Ready). */
export function inStartOrder(rows) {
  const oldestFirst = [...rows].reverse();
  for (let i = 0; i < oldestFirst.length; i++) {
    if (oldestFirst[i].type !== "EngineReady") continue;
    let j = i + 1;
    while (j < oldestFirst.length && oldestFirst[j].type === "EngineMilestoneReached") j++;
    if (j === i + 1) continue;
    const ready = oldestFirst[i];
    const late = oldestFirst.slice(i + 1, j).map((row) => ({ ...row, ts: Math.min(row.ts, ready.ts) }));
    oldestFirst.splice(i, j - i, ...late, ready);
    i = j - 1;
  }
  return oldestFirst.reverse();
}
