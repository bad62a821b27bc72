// The memory and residency timeline (GET api/timeline, dgxmm/admin/timeline.py), drawn with
// uPlot (js/vendor.js): each deployment's memory stacked in its state's colour under the
// usable-memory line, marks for cold starts, sleeps, make-room evictions (with an arrow to
// the model they made room for), failures and the learned policy's pre-warms and keep-warms,
// and queue waits as bars under the chart, one row per model. Hovering a mark shows its event; clicking a wait opens that request's story.
//
// timelineChart({ live: true }) follows the box through the event stream (the same coalesced
// messages as the badges, at most one reload a second): the last hour, or, on a box younger
// than that, everything since its log's first record (the API's default window), so a young
// box fills the chart instead of its rightmost sliver. Every chart zooms and pans the same way
// (from/to, dragging across the chart, the buttons); a live chart that is zoomed or panned
// stops following until its Live button.
// The data drawn is on the page as `window.dgxmmTimeline` and in data-* attributes.

import { api, describeError } from "./api.js";
import { h, replace } from "./dom.js";
import { dateTime } from "./format.js";
import * as liveState from "./live.js";
import { throttle } from "./pages/common.js";
import { chartUnavailable, loadUPlot } from "./vendor.js";

const GIB = 1024 ** 3;
const HOUR = 3600;
const STATE_COLOURS = { starting: "start", ready: "ok", asleep: "sleep", stopping: "neutral" };
const STATE_WORDS = { starting: "Starting", ready: "Ready", asleep: "Asleep", stopping: "Stopping" };
// The learned policy's marks (issue 44): a pre-warm, a sleep after its learned keep-warm, a
// pre-warm no request came to, and one abandoned for a queued request.
const MARK_GLYPHS = {
  cold_start: "▶",
  idle_sleep: "☾",
  make_room: "⇢",
  sleep: "☾",
  failure: "✕",
  prewarm: "◆",
  kept_warm: "◐",
  prewarm_unused: "◇",
  prewarm_abandoned: "⊘",
};
const MARK_WORDS = {
  cold_start: "Cold start",
  idle_sleep: "Idle sleep",
  make_room: "Made room",
  sleep: "Put to sleep",
  failure: "Failure",
  prewarm: "Pre-warm",
  kept_warm: "Kept warm, then slept",
  prewarm_unused: "Pre-warm unused",
  prewarm_abandoned: "Pre-warm abandoned",
};
// Shown in the legend only when the window has one: most boxes run the seed's policy.
const LEARNED_MARKS = new Set(["prewarm", "kept_warm", "prewarm_unused", "prewarm_abandoned"]);
const OUTCOME_WORDS = { waiting: "still waiting", served: "served" };

function css(name, fallback) {
  const value = getComputedStyle(document.documentElement).getPropertyValue(name).trim();
  return value || fallback;
}

function stateColours(state) {
  const key = STATE_COLOURS[state] || "neutral";
  if (key === "neutral") return { fill: css("--neutral-bg", "#eceef2"), line: css("--muted", "#5b6475") };
  return { fill: css(`--${key}-bg`, "#eee"), line: css(`--${key}`, "#333") };
}

function toLocalInput(ts) {
  const d = new Date(ts * 1000);
  const pad = (n) => String(n).padStart(2, "0");
  return `${d.getFullYear()}-${pad(d.getMonth() + 1)}-${pad(d.getDate())}T${pad(d.getHours())}:${pad(d.getMinutes())}:${pad(d.getSeconds())}`;
}

function fromLocalInput(text) {
  const ms = new Date(text).getTime();
  return Number.isFinite(ms) ? ms / 1000 : null;
}

function seconds(s) {
  return s >= 100 ? `${Math.round(s)} s` : `${s.toFixed(1)} s`;
}

/** The event of a mark as readable lines (its hover text). */
function eventLines(mark) {
  const lines = [mark.title, dateTime(mark.ts)];
  if (mark.kind === "cold_start") {
    lines.push(mark.duration_s === null ? "not ready yet" : `ready after ${seconds(mark.duration_s)}`);
    if (mark.request_id) lines.push(`for request ${mark.request_id}`);
  }
  const ev = mark.event || {};
  for (const [key, value] of Object.entries(ev)) {
    if (key === "ts" || value === null || value === "" || (Array.isArray(value) && !value.length)) continue;
    lines.push(`${key}: ${typeof value === "object" ? JSON.stringify(value) : value}`);
  }
  return lines;
}

/** The chart. Options: live (follow the box, until the operator picks a window), focus (a
 * deployment id to stand out), since/until (the first window), id (the element id prefix). */
export function timelineChart({ live = false, focus = null, since = null, until = null, id = "timeline" } = {}) {
  const now = () => Date.now() / 1000;
  let win = { until: until ?? now(), since: since ?? (until ?? now()) - HOUR };
  let following = live; // the API's default window, reloaded as the box changes
  let asked = 0; // windows asked for: a load answering an older one is not drawn
  let data = null;
  let plot = null;
  let destroyed = false;
  let loading = false;
  let again = false; // a reload asked for while one ran

  const status = h("p.muted.tl-status", { role: "status" }, "Loading…");
  const chartEl = h("div.tl-chart");
  const tip = h("div.tl-tip", { role: "tooltip", id: `${id}-tip`, hidden: true });
  const waitsEl = h("div.tl-waits", { id: `${id}-waits` });
  const legend = h("ul.tl-legend", { id: `${id}-legend` });
  const storyText = h("pre.tl-story-text", { id: `${id}-story-text` });
  const storyTitle = h("h2", { id: `${id}-story-title` }, "Request");
  const story = h("dialog.tl-story", { id: `${id}-story`, "aria-labelledby": `${id}-story-title` }, [
    storyTitle,
    storyText,
    h("form", { method: "dialog" }, h("button", { type: "submit" }, "Close")),
  ]);

  const fromInput = h("input", { type: "datetime-local", step: "1", id: `${id}-from`, "aria-label": "Timeline from" });
  const toInput = h("input", { type: "datetime-local", step: "1", id: `${id}-to`, "aria-label": "Timeline to" });
  const liveButton = live
    ? h("button", { type: "button", id: `${id}-live`, "aria-pressed": "true", onclick: () => followAgain() }, "Live")
    : h("button", { type: "button", onclick: () => show(now() - HOUR, now()) }, "Last hour");
  const controls = h("form.tl-controls", { id: `${id}-window` }, [
    h("span.tl-field", ["From ", fromInput]),
    h("span.tl-field", ["To ", toInput]),
    h("button", { type: "submit" }, "Show"),
    h("button", { type: "button", title: "Earlier", "aria-label": "Earlier", onclick: () => pan(-0.5) }, "◀"),
    h("button", { type: "button", title: "Zoom in", "aria-label": "Zoom in", onclick: () => zoom(0.5) }, "+"),
    h("button", { type: "button", title: "Zoom out", "aria-label": "Zoom out", onclick: () => zoom(2) }, "−"),
    h("button", { type: "button", title: "Later", "aria-label": "Later", onclick: () => pan(0.5) }, "▶"),
    liveButton,
  ]);
  controls.addEventListener("submit", (e) => {
    e.preventDefault();
    const from = fromLocalInput(fromInput.value);
    const to = fromLocalInput(toInput.value);
    if (from === null || to === null || from >= to) {
      status.textContent = "Pick a From time before the To time.";
      return;
    }
    show(from, to);
  });
  const mode = live ? h("p.muted.tl-mode", { id: `${id}-mode` }) : null;

  const node = h("section.card.timeline", { id, "aria-labelledby": `${id}-title` }, [
    h("div.card-head", [h("h2", { id: `${id}-title` }, "Timeline"), status]),
    controls,
    mode,
    h("div.tl-frame", [chartEl, tip]),
    waitsEl,
    legend,
    story,
  ]);

  function pan(fraction) {
    const span = win.until - win.since;
    show(win.since + span * fraction, win.until + span * fraction);
  }

  function zoom(factor) {
    const mid = (win.since + win.until) / 2;
    const half = ((win.until - win.since) * factor) / 2;
    show(mid - Math.max(half, 30), mid + Math.max(half, 30));
  }

  /** Show the window from..to; a live chart stops following. */
  function show(from, to) {
    following = false;
    win = { since: from, until: to };
    asked += 1;
    load();
  }

  /** A live chart follows the box again. */
  function followAgain() {
    following = true;
    asked += 1;
    load();
  }

  function showWindow(found) {
    for (const [input, ts] of [[fromInput, found.since], [toInput, found.until]]) {
      if (document.activeElement !== input) input.value = toLocalInput(ts);
    }
    if (!live) return;
    liveButton.setAttribute("aria-pressed", String(following));
    const young = found.until - found.since < HOUR - 1;
    mode.textContent = !following
      ? "A window you picked. Live follows the box again."
      : young
        ? "Live, since the box's first event (it is younger than an hour). Drag across the chart to zoom in."
        : "Live: the last hour. Drag across the chart to zoom in.";
  }

  async function load() {
    if (destroyed) return;
    if (loading) {
      again = true;
      return;
    }
    loading = true;
    const mine = asked;
    // Following: the API's default window (the last hour, fitted to a younger log).
    const query = following ? {} : { since: win.since.toFixed(3), until: win.until.toFixed(3) };
    if (!following) showWindow(win);
    try {
      const [uPlot, found] = await Promise.all([loadUPlot(), api("GET", "timeline", { query })]);
      if (destroyed || mine !== asked) return; // another window was asked for meanwhile
      data = found;
      win = { since: found.since, until: found.until };
      draw(uPlot);
      showWindow(found);
      status.textContent = `${dateTime(found.since)} – ${dateTime(found.until)}`;
    } catch (err) {
      if (destroyed || mine !== asked) return;
      if (err && err.status === undefined && /chart library/.test(err.message)) {
        replace(chartEl, chartUnavailable(err));
        status.textContent = "";
      } else {
        status.textContent = describeError(err);
      }
    } finally {
      loading = false;
      if (again && !destroyed) {
        again = false;
        reloadSoon();
      }
    }
  }

  function laneName(depId) {
    const lane = (data.lanes || []).find((l) => l.deployment_id === depId);
    return lane ? lane.name : depId;
  }

  /** Where a deployment's stack is at `ts` (its piece), for marks and arrows. */
  function pieceAt(depId, ts) {
    let best = null;
    for (const p of data.pieces) {
      if (p.deployment_id !== depId) continue;
      if (p.start <= ts && ts <= p.end) return p;
      if (!best || Math.abs(p.start - ts) < Math.abs(best.start - ts)) best = p;
    }
    return best;
  }

  function markY(mark) {
    const p = pieceAt(mark.deployment_id, mark.kind === "cold_start" && mark.end ? mark.end : mark.ts);
    return p ? p.high_bytes / GIB : 0;
  }

  function arrows() {
    const out = [];
    for (const mark of data.marks) {
      if (mark.kind !== "make_room" || !mark.for_deployment) continue;
      const start = data.marks.find((k) => k.kind === "cold_start" && k.deployment_id === mark.for_deployment && k.ts >= mark.ts);
      out.push({ from: mark.deployment_id, to: mark.for_deployment, x0: mark.ts, x1: start ? start.ts : mark.ts, started: Boolean(start) });
    }
    return out;
  }

  function drawPieces(u) {
    const ctx = u.ctx;
    ctx.save();
    ctx.beginPath();
    ctx.rect(u.bbox.left, u.bbox.top, u.bbox.width, u.bbox.height);
    ctx.clip();
    const dpr = devicePixelRatio || 1;
    for (const p of data.pieces) {
      const x0 = u.valToPos(p.start, "x", true);
      const x1 = Math.max(u.valToPos(p.end, "x", true), x0 + 2 * dpr); // a short stay still shows
      const y0 = u.valToPos(p.low_bytes / GIB, "y", true);
      const y1 = u.valToPos(p.high_bytes / GIB, "y", true);
      const { fill, line } = stateColours(p.state);
      ctx.globalAlpha = focus && p.deployment_id !== focus ? 0.35 : 1;
      ctx.fillStyle = fill;
      ctx.fillRect(x0, y1, x1 - x0, y0 - y1);
      ctx.strokeStyle = line;
      ctx.lineWidth = 1.5 * dpr;
      ctx.strokeRect(x0, y1, x1 - x0, y0 - y1);
      if (x1 - x0 > 70 * dpr && y0 - y1 > 14 * dpr) {
        ctx.fillStyle = line;
        ctx.font = `${12 * dpr}px system-ui, sans-serif`;
        ctx.textBaseline = "middle";
        ctx.fillText(laneName(p.deployment_id), x0 + 6 * dpr, (y0 + y1) / 2, x1 - x0 - 10 * dpr);
      }
    }
    ctx.globalAlpha = 1;
    // Make-room arrows: from the evicted model's lane to the start it made room for.
    ctx.strokeStyle = css("--queued", "#9a3412");
    ctx.fillStyle = ctx.strokeStyle;
    ctx.lineWidth = 2 * dpr;
    for (const a of arrows()) {
      const from = pieceAt(a.from, a.x0);
      const to = pieceAt(a.to, a.x1);
      const x0 = u.valToPos(a.x0, "x", true);
      const y0 = u.valToPos(from ? (from.low_bytes + from.high_bytes) / 2 / GIB : 0, "y", true);
      const x1 = Math.max(u.valToPos(a.x1, "x", true), x0 + 24 * dpr);
      const y1 = u.valToPos(to ? (to.low_bytes + to.high_bytes) / 2 / GIB : 0, "y", true);
      ctx.setLineDash([5 * dpr, 3 * dpr]);
      ctx.beginPath();
      ctx.moveTo(x0, y0);
      ctx.lineTo(x1, y1);
      ctx.stroke();
      ctx.setLineDash([]);
      const angle = Math.atan2(y1 - y0, x1 - x0);
      const size = 8 * dpr;
      ctx.beginPath();
      ctx.moveTo(x1, y1);
      ctx.lineTo(x1 - size * Math.cos(angle - 0.45), y1 - size * Math.sin(angle - 0.45));
      ctx.lineTo(x1 - size * Math.cos(angle + 0.45), y1 - size * Math.sin(angle + 0.45));
      ctx.closePath();
      ctx.fill();
    }
    ctx.restore();
  }

  function placeOverlays(u) {
    for (const el of u.over.querySelectorAll(".tl-mark")) {
      const mark = data.marks[Number(el.dataset.index)];
      const x = u.valToPos(Math.max(mark.ts, data.since), "x");
      el.style.left = `${x}px`;
      el.style.top = `${u.valToPos(markY(mark), "y")}px`;
      el.hidden = mark.ts > data.until;
    }
    waitsEl.style.marginLeft = `${u.over.offsetLeft}px`;
    waitsEl.style.width = `${u.over.clientWidth}px`;
    for (const el of waitsEl.querySelectorAll(".tl-wait")) {
      const w = data.waits[Number(el.dataset.index)];
      const x0 = u.valToPos(Math.max(w.start, data.since), "x");
      const x1 = u.valToPos(Math.min(w.end, data.until), "x");
      el.style.left = `${x0}px`;
      el.style.width = `${Math.max(4, x1 - x0)}px`;
    }
  }

  function showTip(el, lines) {
    replace(tip, lines.map((line, i) => (i === 0 ? h("strong", line) : h("div", line))));
    tip.hidden = false;
    const frame = tip.parentElement.getBoundingClientRect();
    const r = el.getBoundingClientRect();
    tip.style.left = `${Math.min(r.left - frame.left + 12, frame.width - 280)}px`;
    tip.style.top = `${r.bottom - frame.top + 6}px`;
  }

  function hideTip() {
    tip.hidden = true;
  }

  async function openStory(wait) {
    storyTitle.textContent = `Request ${wait.request_id}`;
    storyText.textContent = "Loading…";
    if (!story.open) story.showModal();
    try {
      const found = await api("GET", `requests/${encodeURIComponent(wait.request_id)}/story`);
      storyText.textContent = found.text;
    } catch (err) {
      storyText.textContent = describeError(err);
    }
  }

  function markButton(mark, index) {
    const words = eventLines(mark);
    const el = h(
      `button.tl-mark.tl-${mark.kind}`,
      {
        type: "button",
        "aria-label": words[0],
        dataset: {
          index: String(index),
          kind: mark.kind,
          deployment: mark.deployment_id,
          name: laneName(mark.deployment_id),
          ts: String(mark.ts),
          for: mark.for_deployment || "",
          forName: mark.for_name || "",
          duration: mark.duration_s === null || mark.duration_s === undefined ? "" : String(mark.duration_s),
        },
      },
      MARK_GLYPHS[mark.kind] || "•",
    );
    el.addEventListener("mouseenter", () => showTip(el, words));
    el.addEventListener("focus", () => showTip(el, words));
    el.addEventListener("mouseleave", hideTip);
    el.addEventListener("blur", hideTip);
    return el;
  }

  function drawWaits() {
    const rows = new Map();
    data.waits.forEach((w, index) => {
      if (!rows.has(w.deployment_id)) rows.set(w.deployment_id, []);
      const outcome = OUTCOME_WORDS[w.outcome] || w.outcome.replaceAll("_", " ");
      const label = `Request ${w.request_id} waited ${seconds(w.end - w.start)} for ${laneName(w.deployment_id)}: ${outcome}`;
      const bar = h(
        `button.tl-wait.tl-outcome-${w.outcome}`,
        {
          type: "button",
          title: `${label}. Click for its story.`,
          "aria-label": label,
          dataset: {
            index: String(index),
            request: w.request_id,
            deployment: w.deployment_id,
            name: laneName(w.deployment_id),
            start: String(w.start),
            end: String(w.end),
            outcome: w.outcome,
          },
        },
      );
      bar.addEventListener("click", () => openStory(w));
      rows.get(w.deployment_id).push(bar);
    });
    replace(
      waitsEl,
      rows.size === 0
        ? h("p.muted.tl-nowaits", "No request waited in this window.")
        : [...rows.entries()].map(([depId, bars]) =>
            h("div.tl-wait-row", { dataset: { deployment: depId } }, [
              h("span.tl-wait-label", `Queue: ${laneName(depId)}`),
              h("div.tl-wait-track", bars),
            ]),
          ),
      data.waits_omitted ? h("p.hint", `${data.waits_omitted} shorter waits not drawn.`) : null,
    );
  }

  function drawLegend() {
    const items = Object.entries(STATE_WORDS).map(([state, word]) => {
      const { fill, line } = stateColours(state);
      return h("li", [h("span.swatch", { style: `background:${fill};border:1.5px solid ${line}`, "aria-hidden": "true" }), word]);
    });
    items.push(h("li", [h("span.swatch.tl-usable-swatch", { "aria-hidden": "true" }), `Usable ${(data.usable_bytes / GIB).toFixed(0)} GiB`]));
    const kinds = new Set(data.marks.map((mark) => mark.kind));
    for (const [kind, word] of Object.entries(MARK_WORDS)) {
      if (kind === "sleep" || (LEARNED_MARKS.has(kind) && !kinds.has(kind))) continue;
      items.push(h("li", [h(`span.tl-glyph.tl-${kind}`, { "aria-hidden": "true" }, MARK_GLYPHS[kind]), word]));
    }
    replace(legend, items);
  }

  function draw(uPlot) {
    const usable = data.usable_bytes / GIB;
    const top = Math.max(usable, ...data.pieces.map((p) => p.high_bytes / GIB), 1) * 1.12;
    const width = Math.max(320, node.clientWidth - 32 || chartEl.clientWidth || 800);
    const opts = {
      width,
      height: 260,
      legend: { show: false },
      scales: {
        x: { time: true, range: () => [data.since, data.until] },
        y: { range: () => [0, top] },
      },
      axes: [
        { stroke: css("--muted", "#5b6475"), grid: { stroke: css("--line", "#d9dde5") } },
        {
          stroke: css("--muted", "#5b6475"),
          grid: { stroke: css("--line", "#d9dde5") },
          values: (u, vals) => vals.map((v) => `${v} GiB`),
          size: 64,
        },
      ],
      series: [
        {},
        { label: "Usable", stroke: css("--danger", "#b42318"), width: 1.5, dash: [6, 4], points: { show: false } },
      ],
      cursor: { drag: { x: true, y: false, setScale: false }, points: { show: false } },
      hooks: {
        drawClear: [drawPieces],
        draw: [placeOverlays],
        setSelect: [
          (u) => {
            if (u.select.width < 4) return;
            const from = u.posToVal(u.select.left, "x");
            const to = u.posToVal(u.select.left + u.select.width, "x");
            u.setSelect({ left: 0, width: 0, top: 0, height: 0 }, false);
            show(from, to);
          },
        ],
      },
    };
    if (plot) plot.destroy();
    replace(chartEl);
    plot = new uPlot(opts, [[data.since, data.until], [usable, usable]], chartEl);
    plot.root.setAttribute("role", "img");
    plot.root.setAttribute(
      "aria-label",
      `Stacked chart of the box over time, ${dateTime(data.since)} – ${dateTime(data.until)}; its marks and queue bars are buttons.`,
    );
    data.marks.forEach((mark, index) => plot.over.append(markButton(mark, index)));
    drawWaits();
    drawLegend();
    placeOverlays(plot);
    window.dgxmmTimeline = { ...data, arrows: arrows() };
    node.dataset.since = String(data.since);
    node.dataset.until = String(data.until);
    node.dataset.loaded = String(Date.now());
  }

  const reloadSoon = throttle(load, 1000);
  const unsubscribe = live
    ? liveState.subscribe((kind) => {
        if (!following) return;
        if (kind === "deployment" || kind === "queue" || kind === "memory" || kind === "removed") reloadSoon();
      })
    : () => {};
  const slide = live ? setInterval(() => following && reloadSoon(), 15_000) : null;
  const onResize = throttle(() => {
    if (plot && data) plot.setSize({ width: Math.max(320, node.clientWidth - 32), height: 260 });
  }, 250);
  window.addEventListener("resize", onResize);
  load();

  return {
    node,
    show,
    destroy() {
      destroyed = true;
      unsubscribe();
      reloadSoon.cancel();
      onResize.cancel();
      if (slide) clearInterval(slide);
      window.removeEventListener("resize", onResize);
      if (plot) plot.destroy();
    },
  };
}
