// Settings: the on-demand defaults and the LiteLLM integration.

import { api, describeError } from "../api.js";
import { field, h, replace } from "../dom.js";
import { dateTime, makeRoomText, minutes, relativeTime } from "../format.js";
import * as live from "../live.js";
import { busy } from "./common.js";
import { tunePanel } from "./tune.js";

function numberIn(text, lo, hi, label) {
  const value = Number(String(text).trim().replace(",", "."));
  if (!String(text).trim() || !Number.isFinite(value) || value < lo || value > hi) {
    throw new Error(`${label}: a number from ${lo} to ${hi}`);
  }
  return value;
}

function wholeIn(text, lo, hi, label) {
  const value = numberIn(text, lo, hi, label);
  if (!Number.isInteger(value)) throw new Error(`${label}: a whole number from ${lo} to ${hi}`);
  return value;
}

// `ondemand_policy`: the DGXMM default of how on-demand models are kept warm (issue 44).
const POLICY_WORDS = { seed: "Seed's rules (idle timeout)", learned: "Learned from each model's traffic" };

export function render({ isAdmin, notify }) {
  const defaultsBody = h("div", { id: "defaults" }, h("p.muted", "Loading…"));
  const litellmBody = h("div", { id: "litellm" }, h("p.muted", "Loading…"));
  const node = h("section.settings-page", [
    h("h1", "Settings"),
    h("div.grid", [
      h("section.card", { "aria-labelledby": "defaults-title" }, [h("h2#defaults-title", "On-demand defaults"), defaultsBody]),
      h("section.card", { "aria-labelledby": "litellm-title" }, [h("h2#litellm-title", "LiteLLM"), litellmBody]),
      ...(isAdmin ? [tunePanel()] : []),
    ]),
  ]);

  // --- on-demand defaults --------------------------------------------------------------
  function drawDefaults(s) {
    if (!isAdmin) {
      replace(
        defaultsBody,
        h("dl.facts", [
          h("div", [h("dt", "Idle minutes before sleeping"), h("dd", minutes(s.ondemand_idle_timeout_s))]),
          h("div", [h("dt", "Longest wait for a request (minutes)"), h("dd", minutes(s.ondemand_queue_timeout_s))]),
          h("div", [h("dt", "Most requests waiting at a time"), h("dd", String(s.ondemand_max_queued))]),
          h("div", [h("dt", "Idle models make room"), h("dd", makeRoomText(s.ondemand_make_room_after_s))]),
          h("div", [h("dt", "How models are kept warm"), h("dd", POLICY_WORDS[s.ondemand_policy || "seed"])]),
        ]),
        h("p.hint", "Only an administrator can change these."),
      );
      return;
    }
    const idle = field(
      "Idle minutes before sleeping",
      h("input", { type: "number", min: "1", max: "1440", step: "any", value: minutes(s.ondemand_idle_timeout_s), id: "set-idle" }),
      "For on-demand deployments that use the default (1 to 1440).",
    );
    const queue = field(
      "Longest wait for a request (minutes)",
      h("input", { type: "number", min: "0.1", max: "1440", step: "any", value: minutes(s.ondemand_queue_timeout_s), id: "set-queue" }),
      "Queue time plus the model's cold start; set it well above your slowest start. Then the request gets 503.",
    );
    const maxQueued = field(
      "Most requests waiting at a time",
      h("input", { type: "number", min: "1", max: "10000", step: "1", value: String(s.ondemand_max_queued), id: "set-maxq" }),
      "All on-demand models together; one more is refused at once.",
    );
    const room = s.ondemand_make_room_after_s;
    const makeRoom = field(
      "Make room after (seconds)",
      h("input", { type: "number", min: "0", max: "86400", step: "1", value: room === null || room === undefined ? "" : String(room), placeholder: "full idle timeout", id: "set-make-room" }),
      "An idle on-demand model with no request for this long may be put to sleep so the request at the head of the queue can start. Empty: only after its full idle timeout (protects recently used models). 0: as soon as nothing is in flight (fast swaps, more cold starts).",
    );
    const policy = field(
      "How models are kept warm",
      h(
        "select",
        { id: "set-policy" },
        Object.entries(POLICY_WORDS).map(([value, words]) => h("option", { value, selected: (s.ondemand_policy || "seed") === value }, words)),
      ),
      "For on-demand deployments that use the default. Learned: each model stays warm through the gaps its own traffic usually has, and a model used on a schedule is started just before its next request (it needs the traffic trace).",
    );
    const error = h("p.error", { role: "alert", hidden: true });
    const save = h("button.primary", { type: "submit" }, "Save defaults");
    const form = h("form", { novalidate: true, id: "defaults-form" }, [idle.wrap, queue.wrap, maxQueued.wrap, makeRoom.wrap, policy.wrap, error, h("div.actions", save)]);
    form.addEventListener("submit", async (event) => {
      event.preventDefault();
      error.hidden = true;
      let wanted;
      try {
        wanted = {
          ondemand_idle_timeout_s: Math.round(numberIn(idle.control.value, 1, 1440, "Idle minutes before sleeping") * 60),
          ondemand_queue_timeout_s: Math.max(1, Math.round(numberIn(queue.control.value, 0.1, 1440, "Longest wait for a request") * 60)),
          ondemand_max_queued: Math.round(numberIn(maxQueued.control.value, 1, 10000, "Most requests waiting")),
          ondemand_make_room_after_s: makeRoom.control.value.trim()
            ? wholeIn(makeRoom.control.value, 0, 86400, "Make room after (seconds)")
            : null,
          ondemand_policy: policy.control.value,
        };
      } catch (err) {
        error.textContent = `${err.message}.`;
        error.hidden = false;
        return;
      }
      const changes = Object.fromEntries(Object.entries(wanted).filter(([k, v]) => (s[k] ?? null) !== v));
      if (Object.keys(changes).length === 0) {
        notify("Nothing changed.");
        return;
      }
      const saved = await busy(save, "Saving…", () => api("PATCH", "settings", { body: changes }), error);
      if (saved) {
        live.state.settings = saved;
        notify("Defaults saved.");
        drawDefaults(saved);
      }
    });
    replace(defaultsBody, form);
  }

  // --- LiteLLM -------------------------------------------------------------------------
  function statusWords(st) {
    if (!st.enabled) return h("span.badge.badge-neutral", "Turned off");
    if (st.ok === null || st.ok === undefined) return h("span.badge.badge-starting", "Not synced yet");
    return st.ok ? h("span.badge.badge-ready", "Synced") : h("span.badge.badge-failed", "Sync failed");
  }
  function loadedWords(st) {
    if (st.loaded === true) return [h("span.badge.badge-ready", "Loaded"), st.loaded_at ? [" (checked ", relativeTime(st.loaded_at), ")"] : ""];
    const why = st.load_error ? ` ${st.load_error}` : "";
    if (st.loaded === false) return [h("span.badge.badge-failed", "Not loaded"), why];
    return [h("span.badge.badge-neutral", "Unknown"), why];
  }
  function reloadFacts(r) {
    const seconds = (v) => `${Number(v).toFixed(1)} s`;
    const facts = [["Reload after a write", r.mode === "command" ? "Reload command (gunicorn: new workers, no outage)" : "LiteLLM's --reload (restarts its worker: an outage)"]];
    const times = (r.recent || []).map((x) => seconds(x.duration_s)).join(", ");
    facts.push(["Reloads", `${r.reloads || 0} since DGXMM started${r.pending ? ", one under way" : ""}${times ? `; write to served: ${times}` : ""}`]);
    if (r.last_error) {
      const when = r.last_error_at ? [" (", relativeTime(r.last_error_at), ")"] : "";
      const badge = r.failing ? h("span.badge.badge-failed", "Failing") : h("span.badge.badge-neutral", "Recovered");
      facts.push(["Reload failures", [badge, ` ${r.failures} so far; the last`, when, `: ${r.last_error}`]]);
    }
    return facts;
  }
  function drawLiteLLM(st) {
    const facts = [
      ["Status", statusWords(st)],
      ["Last sync", st.last_sync_at ? [relativeTime(st.last_sync_at), ` (${dateTime(st.last_sync_at)})`] : "never"],
    ];
    if (st.error) facts.push(["Last error", st.error]);
    if (st.url) facts.push(["Address", h("span.nowrap", st.url)]);
    if (st.backend) facts.push(["How DGXMM updates it", st.backend === "api" ? "Model-management API" : `Config file ${st.config_path || ""}`]);
    if (st.entries !== undefined) facts.push(["Models registered", String(st.entries)]);
    if (st.backend === "file" && st.enabled) {
      facts.push(["Last write of the file", st.last_write_at ? [relativeTime(st.last_write_at), ` (${dateTime(st.last_write_at)})`] : "none since DGXMM started"]);
      // A write restarts LiteLLM's worker only when LiteLLM runs (with --reload): the count
      // is of writes, and says restarts only of a LiteLLM that answers.
      const hitless = st.reload && st.reload.mode === "command";
      const answering = st.loaded === true;
      const effect = hitless
        ? "each followed by the reload command"
        : answering
          ? "each restarts LiteLLM's worker"
          : "LiteLLM is not answering, so none restarted it";
      facts.push(["Writes of LiteLLM's config", `${st.config_writes || 0} since DGXMM started (${effect})`]);
      facts.push(["Loaded by LiteLLM", loadedWords(st)]);
      if (st.reload) facts.push(...reloadFacts(st.reload));
    }
    if (st.master_key_env) facts.push(["Master key", st.master_key_set ? `set (${st.master_key_env})` : `not set: export ${st.master_key_env}`]);
    facts.push(["Deploy wizard's default mode", st.default_mode === "on_demand" ? "On demand" : "Always on"]);
    const parts = [h("dl.facts", { id: "litellm-facts" }, facts.map(([k, v]) => h("div", [h("dt", k), h("dd", v)])))];
    if (st.hint) parts.push(h("p.hint", st.hint));
    if (isAdmin) {
      const error = h("p.error", { role: "alert", hidden: true });
      const sync = h("button.primary", { type: "button", id: "litellm-sync", disabled: !st.enabled }, "Sync now");
      sync.addEventListener("click", async () => {
        const fresh = await busy(sync, "Syncing…", () => api("POST", "litellm/sync"), error);
        if (fresh) {
          drawLiteLLM(await api("GET", "litellm").catch(() => fresh));
          notify(fresh.ok ? "LiteLLM is in step with DGXMM." : "The sync failed; see the last error.", fresh.ok ? "info" : "error");
        }
      });
      parts.push(error, h("div.actions", sync), integrationForm(st));
    }
    replace(litellmBody, ...parts);
  }

  function integrationForm(st) {
    const enabled = h("input", { type: "checkbox", id: "litellm-enabled", checked: Boolean(st.enabled) });
    const url = field("LiteLLM address", h("input", { type: "url", value: st.url || "", spellcheck: "false" }));
    const backend = field(
      "How DGXMM updates LiteLLM",
      h("select", [
        h("option", { value: "file", selected: st.backend !== "api" }, "Config file (LiteLLM run with --reload, or reloaded by reload_command)"),
        h("option", { value: "api", selected: st.backend === "api" }, "Model-management API (LiteLLM with a database)"),
      ]),
    );
    const error = h("p.error", { role: "alert", hidden: true });
    const save = h("button.secondary", { type: "submit" }, "Save integration");
    const form = h("form", { novalidate: true }, [
      h("div.field.check", [enabled, h("label", { for: enabled.id }, "Keep LiteLLM's model list in step with DGXMM")]),
      url.wrap,
      backend.wrap,
      error,
      h("div.actions", save),
    ]);
    form.addEventListener("submit", async (event) => {
      event.preventDefault();
      const changes = {};
      if (enabled.checked !== Boolean(st.enabled)) changes.enabled = enabled.checked;
      if (url.control.value.trim() && url.control.value.trim() !== st.url) changes.url = url.control.value.trim();
      if (backend.control.value !== st.backend) changes.backend = backend.control.value;
      if (Object.keys(changes).length === 0) {
        notify("Nothing changed.");
        return;
      }
      const fresh = await busy(save, "Saving…", () => api("PATCH", "litellm", { body: changes }), error);
      if (fresh) {
        notify("LiteLLM integration saved.");
        drawLiteLLM(await api("GET", "litellm").catch(() => fresh));
      }
    });
    return h("details.integration", [h("summary", "Integration settings"), form]);
  }

  api("GET", "settings")
    .then(drawDefaults)
    .catch((err) => replace(defaultsBody, h("p.error", describeError(err))));
  api("GET", "litellm")
    .then(drawLiteLLM)
    .catch((err) => replace(litellmBody, h("p.error", describeError(err))));
  return { node, title: "Settings" };
}
