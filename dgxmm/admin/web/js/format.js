// How numbers, times, modes and states are written in the UI.

import { h } from "./dom.js";

const GIB = 1024 ** 3;

export function gib(bytes) {
  if (bytes === null || bytes === undefined) return "—";
  const value = bytes / GIB;
  const digits = value >= 100 || Number.isInteger(value) ? 0 : 1;
  return `${value.toFixed(digits)} GiB`;
}

/** Seconds as minutes, the way the seed writes them: 300 -> "5", 90 -> "1.5". */
export function minutes(seconds) {
  const value = seconds / 60;
  return String(Number.isInteger(value) ? value : Number(value.toFixed(2)));
}

export function modeLabel(mode) {
  return mode === "on_demand" ? "On demand" : "Always on";
}

/** "On demand, sleeps after 5 min idle (the default)" and friends. */
export function modeSummary(rec) {
  if (rec.role === "decision") return "Always on (decision model)";
  if (rec.mode !== "on_demand") {
    return "Always on";
  }
  const idle = `sleeps after ${minutes(rec.effective_idle_timeout_s)} min idle`;
  return `On demand, ${idle}${rec.idle_timeout_s === null ? " (the default)" : ""}`;
}

export function dateTime(epochSeconds) {
  if (epochSeconds === null || epochSeconds === undefined) return "—";
  const d = new Date(epochSeconds * 1000);
  return d.toLocaleString(undefined, {
    year: "numeric",
    month: "short",
    day: "numeric",
    hour: "2-digit",
    minute: "2-digit",
    second: "2-digit",
  });
}

export function relative(epochSeconds, now = Date.now() / 1000) {
  if (epochSeconds === null || epochSeconds === undefined) return "never";
  const ago = Math.max(0, Math.round(now - epochSeconds));
  if (ago < 5) return "just now";
  if (ago < 60) return `${ago} s ago`;
  if (ago < 3600) return `${Math.floor(ago / 60)} min ago`;
  if (ago < 86400) return `${Math.floor(ago / 3600)} h ago`;
  return dateTime(epochSeconds);
}

/** A <time> that keeps its "3 min ago" text fresh (see tickRelativeTimes). */
export function relativeTime(epochSeconds) {
  if (epochSeconds === null || epochSeconds === undefined) return h("span.muted", "never");
  return h(
    "time.rel",
    {
      datetime: new Date(epochSeconds * 1000).toISOString(),
      title: dateTime(epochSeconds),
      dataset: { epoch: String(epochSeconds) },
    },
    relative(epochSeconds),
  );
}

export function tickRelativeTimes(root = document) {
  const now = Date.now() / 1000;
  for (const el of root.querySelectorAll("time.rel")) {
    el.textContent = relative(Number(el.dataset.epoch), now);
  }
}

/** The colour family of a badge text. */
export function badgeKind(text) {
  if (/^\d+ queued$/.test(text)) return "queued";
  switch (text) {
    case "Ready":
      return "ready";
    case "Sleeping (on demand)":
      return "sleeping";
    case "Starting for a request":
    case "Loading":
      return "starting";
    case "Failed":
      return "failed";
    default:
      return "neutral";
  }
}

export function badge(text) {
  return h(`span.badge.badge-${badgeKind(text)}`, { "data-badge": text }, text);
}

/** Audit actions in words (the audit page keeps the code too). */
export const ACTIONS = {
  deployment_create: "Deployment created",
  deployment_remove: "Deployment removed",
  deployment_reconfigure: "Deployment reconfigured",
  deployment_switch_model: "Model switched",
  deployment_start: "Started",
  deployment_stop: "Stopped",
  deployment_start_failed: "Start failed",
  ondemand_mode: "Mode changed",
  ondemand_start: "Started for a request",
  ondemand_sleep: "Put to sleep",
  ondemand_queue_timeout: "Queued request timed out",
  watchdog_stop: "Stopped by the memory watchdog",
  engine_lost: "Engine lost",
  settings_change: "Settings changed",
  user_create: "User created",
  user_remove: "User removed",
  api_token_create: "API token created",
  api_token_revoke: "API token revoked",
  user_role_change: "User role changed",
  password_change: "Password changed",
  login: "Logged in",
  login_failed: "Login failed",
};

export function actionWords(row) {
  const base = ACTIONS[row.action] || row.action;
  const d = row.details || {};
  if (row.action === "ondemand_sleep") {
    if (d.reason === "idle") return "Put to sleep after its idle timeout";
    if (d.reason === "make_room") return `Put to sleep to make room for ${d.for ?? "another model"}`;
  }
  if (row.action === "ondemand_mode") {
    if (d.mode === "always_on") return "Mode changed to always on";
    const idle =
      d.idle_timeout_s === null || d.idle_timeout_s === undefined
        ? "default idle timeout"
        : `sleep after ${minutes(d.idle_timeout_s)} min idle`;
    return `Mode changed to on demand (${idle})`;
  }
  if (row.action === "deployment_switch_model" && d.model) return `Model switched to ${d.model}`;
  if (row.action === "deployment_start_failed" && d.reason) return `Start failed: ${d.reason}`;
  return base;
}

export function detailsText(details) {
  if (!details) return "";
  return Object.entries(details)
    .filter(([, v]) => v !== null && v !== undefined && v !== "")
    .map(([k, v]) => {
      // A unit in the key's name goes after the value: "idle timeout: 120 s".
      const unit = /_s$/.test(k) && typeof v === "number" ? " s" : "";
      const name = (unit ? k.slice(0, -2) : k).replaceAll("_", " ");
      return `${name}: ${typeof v === "object" ? JSON.stringify(v) : v}${unit}`;
    })
    .join(", ");
}

/** Engine arguments written back so that splitting them again gives the same list. */
export function quoteArgs(args) {
  return args
    .map((a) => (a === "" || /[\s'"\\]/.test(a) ? `"${a.replace(/(["\\])/g, "\\$1")}"` : a))
    .join(" ");
}

export const ENGINE_NAMES = {
  vllm: "vLLM",
  llamacpp: "llama.cpp",
  sglang: "SGLang",
  sim: "Simulated",
};

export function engineName(engine) {
  return ENGINE_NAMES[engine] || engine;
}

/** When an idle on-demand model may sleep to make room (ondemand_make_room_after_s). */
export function makeRoomText(seconds) {
  if (seconds === null || seconds === undefined) return "after its full idle timeout";
  if (seconds === 0) return "as soon as nothing is in flight";
  return `after ${seconds} s without a request`;
}
