// The deploy wizard: step 1 what to run, step 2 the mode.

import { api, describeError } from "../api.js";
import { field, h, replace } from "../dom.js";
import { ENGINE_NAMES, minutes, quoteArgs } from "../format.js";
import * as live from "../live.js";

export const HINT = "On demand needs LiteLLM (it starts models on requests that come through it)";
const NAME_RE = /^[A-Za-z0-9][A-Za-z0-9._:/-]{0,127}$/;

/** Split engine arguments like a shell would for plain words and quotes (no expansion). */
export function splitArgs(text) {
  const args = [];
  let current = "";
  let quote = null;
  let started = false;
  for (let i = 0; i < text.length; i += 1) {
    const c = text[i];
    if (quote) {
      if (c === quote) quote = null;
      else if (c === "\\" && quote === '"' && i + 1 < text.length) current += text[++i];
      else current += c;
    } else if (c === "'" || c === '"') {
      quote = c;
      started = true;
    } else if (c === "\\" && i + 1 < text.length) {
      current += text[++i];
      started = true;
    } else if (/\s/.test(c)) {
      if (started) args.push(current);
      current = "";
      started = false;
    } else {
      current += c;
      started = true;
    }
  }
  if (quote) throw new Error(`Engine arguments: a ${quote === '"' ? "double" : "single"} quote is not closed`);
  if (started) args.push(current);
  return args;
}

/** "Make room after" seconds as typed -> seconds (null when empty: the default), or an error. */
export function makeRoomSeconds(text) {
  const trimmed = String(text ?? "").trim();
  if (!trimmed) return { seconds: null };
  const value = Number(trimmed);
  if (!Number.isInteger(value) || value < 0 || value > 86400) {
    return { error: "Make room after (seconds): a whole number from 0 to 86400, or empty for the default." };
  }
  return { seconds: value };
}

/** Idle minutes as typed -> seconds, or an error message. */
export function idleSeconds(text) {
  const value = Number(String(text).trim().replace(",", "."));
  if (!String(text).trim() || !Number.isFinite(value)) return { error: "Idle minutes before sleeping: enter a number from 1 to 1440." };
  if (value < 1 || value > 1440) return { error: "Idle minutes before sleeping: from 1 to 1440." };
  return { seconds: Math.round(value * 60) };
}

export function render({ navigate, notify }) {
  let step = 1;
  let defaultIdleS = 300;
  let defaultMode = "always_on";
  let hint = HINT;

  const error = h("p.error", { role: "alert", id: "wizard-error", hidden: true });
  const stepsNav = h("ol.steps", { "aria-label": "Steps" });

  // --- step 1 ---------------------------------------------------------------------
  const name = field(
    "Name",
    h("input", { type: "text", name: "name", required: true, autocomplete: "off", spellcheck: "false", maxlength: "128" }),
    "The model name clients ask LiteLLM for. Letters, digits and . _ : / -",
  );
  const engine = field(
    "Engine",
    h(
      "select",
      { name: "engine" },
      Object.entries(ENGINE_NAMES).map(([value, label]) =>
        h("option", { value }, value === "sim" ? `${label} (no GPU, for trying DGXMM)` : label),
      ),
    ),
  );
  const model = field(
    "Model",
    h("input", { type: "text", name: "model", required: true, autocomplete: "off", spellcheck: "false" }),
    "What the engine loads, e.g. a Hugging Face id such as Qwen/Qwen3-8B or a GGUF file.",
  );
  const memory = field(
    "Memory (GiB)",
    h("input", { type: "number", name: "memory_gib", min: "0.1", step: "0.1", inputmode: "decimal", required: true }),
    "What the engine may hold. DGXMM keeps all deployments within the usable memory.",
  );
  // The memory step's expected start time: the history of a deployment of the same engine
  // and model on this box (the median of its last cold starts), labelled as an estimate.
  const startHint = h("p.hint", { id: "wiz-start-estimate", hidden: true });
  memory.wrap.append(startHint);
  function showStartEstimate() {
    const same = [...live.state.deployments.values()].filter(
      (d) => d.engine === engine.control.value && d.model === model.control.value.trim() && d.expected_start_s != null,
    );
    startHint.hidden = !same.length;
    if (same.length) {
      const d = same[0];
      startHint.textContent = `Expected start: about ${Math.round(d.expected_start_s)} s (est., from ${d.name}'s last cold starts).`;
    }
  }
  model.control.addEventListener("input", showStartEstimate);
  engine.control.addEventListener("change", showStartEstimate);
  // The memory step's free memory now (`GET /memory`) and whether the declared memory fits.
  // Not an alarm when it does not: on demand it starts on its next request.
  let budget = null;
  const memoryFit = h("p.hint", { id: "wiz-memory-fit", hidden: true });
  memory.wrap.append(memoryFit);
  const gib = (bytes) => String(Math.round((bytes / 1024 ** 3) * 10) / 10);
  function showMemoryFit() {
    memoryFit.hidden = !budget;
    if (!budget) return;
    const free = gib(budget.free_bytes);
    const mem = Number(memory.control.value);
    if (!memory.control.value || !Number.isFinite(mem) || mem <= 0) {
      memoryFit.textContent = `${free} GiB free now (of ${gib(budget.usable_bytes)} GiB usable).`;
    } else if (mem * 1024 ** 3 > budget.usable_bytes) {
      memoryFit.textContent = `${mem} GiB is more than the ${gib(budget.usable_bytes)} GiB usable on this box.`;
    } else if (mem * 1024 ** 3 <= budget.free_bytes) {
      memoryFit.textContent = `Fits: ${free} GiB free now.`;
    } else {
      memoryFit.textContent =
        `${mem} GiB does not fit now (${free} GiB free). On demand, it starts on its next request, making room then if it can. ` +
        "Always on: free memory, then start it.";
    }
  }
  memory.control.addEventListener("input", showMemoryFit);
  // Without a GPU, vLLM and SGLang cannot run: the default engine is then the simulated one.
  const engineHint = h("p.hint", { id: "wiz-engine-hint", hidden: true });
  engine.wrap.append(engineHint);
  let engineChosen = false;
  engine.control.addEventListener("change", () => {
    engineChosen = true;
    engineHint.hidden = true;
  });
  function loadMemory() {
    return api("GET", "memory")
      .then((m) => {
        if (budget === null && m.gpu === false && !engineChosen) {
          engine.control.value = "sim";
          engineHint.textContent =
            "No GPU was detected, so the simulated engine is chosen: it runs anywhere and needs no download. " +
            "llama.cpp runs GGUF models on the CPU; vLLM and SGLang need a GPU.";
          engineHint.hidden = false;
          showStartEstimate();
        }
        budget = m;
        showMemoryFit();
      })
      .catch(() => {});
  }
  loadMemory();
  // A start that ends while the wizard is open brings its history: look again.  The page
  // has no teardown, so the listener leaves once the wizard is gone.
  let attached = false;
  const unsubscribe = live.subscribe((kind) => {
    if (!startHint.isConnected) {
      if (attached) unsubscribe();
      return;
    }
    attached = true;
    if (kind === "deployment" || kind === "snapshot") showStartEstimate();
    if (kind === "memory") loadMemory();
  });
  const args = field(
    "Engine arguments",
    h("textarea", { name: "args", rows: "2", spellcheck: "false" }),
    "Optional. Passed to the engine as given: separate them with spaces, quote one that contains spaces.",
  );
  const decision = h("input", { type: "checkbox", name: "decision", id: "wiz-decision", "aria-describedby": "wiz-decision-hint" });
  const decisionWrap = h("div.field.check", [
    decision,
    h("label", { for: "wiz-decision" }, "This is the decision model (always on)"),
    h("p.hint", { id: "wiz-decision-hint" }, "The small model that routes each request to a model (for example LiteLLM's auto-router). DGXMM keeps it always on and never puts it to sleep to make room. Leave this off for an ordinary model."),
  ]);
  const step1 = h("fieldset.step", { id: "wizard-step-1" }, [
    h("legend", "Step 1 of 2: what to run"),
    name.wrap,
    engine.wrap,
    model.wrap,
    memory.wrap,
    args.wrap,
    decisionWrap,
  ]);

  // --- step 2 ---------------------------------------------------------------------
  const onDemandText = h("span");
  const onDemand = h("input", { type: "radio", name: "mode", value: "on_demand", id: "wiz-mode-ondemand" });
  const alwaysOn = h("input", { type: "radio", name: "mode", value: "always_on", id: "wiz-mode-always" });
  const modeHint = h("p.hint.mode-hint", { id: "wiz-mode-hint", hidden: true });
  const decisionNote = h("p.hint", { hidden: true }, "The decision model is always on.");
  const idle = field(
    "Idle minutes before sleeping",
    h("input", { type: "number", name: "idle_minutes", min: "1", max: "1440", step: "any", inputmode: "decimal" }),
  );
  const idleHint = h("p.hint", { id: "wiz-idle-hint" });
  idle.control.setAttribute("aria-describedby", idleHint.id);
  idle.wrap.append(idleHint);
  const makeRoom = field(
    "Make room after (seconds)",
    h("input", { type: "number", name: "make_room_after_s", id: "wiz-make-room", min: "0", max: "86400", step: "1", inputmode: "numeric", placeholder: "default" }),
    "How long without a request before it may sleep so a queued model can start. Empty: the DGXMM default (Settings); 0: as soon as nothing is in flight.",
  );
  const summary = h("dl.summary", { id: "wizard-summary" });
  const step2 = h("fieldset.step", { id: "wizard-step-2", hidden: true }, [
    h("legend", "Step 2 of 2: mode"),
    h("fieldset.radios", { "aria-describedby": modeHint.id }, [
      h("legend", "Mode"),
      h("div.radio", [onDemand, h("label", { for: onDemand.id }, onDemandText)]),
      h("div.radio", [alwaysOn, h("label", { for: alwaysOn.id }, "Always on")]),
      modeHint,
      decisionNote,
    ]),
    idle.wrap,
    makeRoom.wrap,
    h("h3", "Summary"),
    summary,
  ]);

  const back = h("button.secondary", { type: "button", hidden: true }, "Back");
  const next = h("button.primary", { type: "submit" }, "Next");
  const form = h("form.card.wizard", { novalidate: true, "aria-labelledby": "wizard-title" }, [
    stepsNav,
    step1,
    step2,
    error,
    h("div.actions", [next, back]),
  ]);
  const node = h("section", [h("h1#wizard-title", "Deploy a model"), form]);

  function idleMinutesText() {
    const parsed = idleSeconds(idle.control.value);
    return parsed.error ? minutes(defaultIdleS) : minutes(parsed.seconds);
  }

  function drawMode() {
    onDemandText.textContent = `On demand — start on the first request, sleep after ${idleMinutesText()} min idle`;
    const isDecision = decision.checked;
    onDemand.disabled = isDecision;
    if (isDecision) alwaysOn.checked = true;
    decisionNote.hidden = !isDecision;
    idle.wrap.hidden = !onDemand.checked;
    makeRoom.wrap.hidden = !onDemand.checked;
    modeHint.hidden = !(hint && defaultMode !== "on_demand") || isDecision;
    modeHint.textContent = hint || "";
    const parsed = idleSeconds(idle.control.value);
    idleHint.textContent =
      !parsed.error && parsed.seconds === defaultIdleS
        ? `The default (${minutes(defaultIdleS)} min): it follows later changes of the default in Settings.`
        : `1 to 1440. The default is ${minutes(defaultIdleS)} min.`;
  }

  function drawSteps() {
    replace(
      stepsNav,
      ["What to run", "Mode"].map((text, i) =>
        h("li", { "aria-current": step === i + 1 ? "step" : null, class: step === i + 1 ? "current" : "" }, `${i + 1}. ${text}`),
      ),
    );
    step1.hidden = step !== 1;
    step2.hidden = step !== 2;
    back.hidden = step !== 2;
    next.textContent = step === 1 ? "Next" : "Deploy";
  }

  function fail(message, control) {
    error.textContent = message;
    error.hidden = false;
    if (control) {
      control.setAttribute("aria-invalid", "true");
      control.focus();
    }
  }

  function checkStep1() {
    for (const c of [name.control, model.control, memory.control, args.control]) c.removeAttribute("aria-invalid");
    const n = name.control.value.trim();
    if (!n) return fail("Name: enter the name clients will use.", name.control);
    if (!NAME_RE.test(n)) return fail("Name: use letters, digits and . _ : / - only, starting with a letter or digit.", name.control);
    if (!model.control.value.trim()) return fail("Model: enter what the engine should load.", model.control);
    const mem = Number(memory.control.value);
    if (!memory.control.value || !Number.isFinite(mem) || mem <= 0) return fail("Memory: enter the GiB the engine may use, more than 0.", memory.control);
    try {
      splitArgs(args.control.value);
    } catch (err) {
      return fail(`${err.message}.`, args.control);
    }
    return true;
  }

  function body() {
    const mode = onDemand.checked ? "on_demand" : "always_on";
    let idleTimeout = null;
    if (mode === "on_demand") {
      const parsed = idleSeconds(idle.control.value);
      if (parsed.error) throw Object.assign(new Error(parsed.error), { control: idle.control });
      // Left at the default: send null, so it follows later changes of the default.
      idleTimeout = parsed.seconds === defaultIdleS ? null : parsed.seconds;
    }
    let makeRoomAfter = null;
    if (mode === "on_demand") {
      const room = makeRoomSeconds(makeRoom.control.value);
      if (room.error) throw Object.assign(new Error(room.error), { control: makeRoom.control });
      makeRoomAfter = room.seconds;
    }
    return {
      name: name.control.value.trim(),
      engine: engine.control.value,
      model: model.control.value.trim(),
      memory_gib: Number(memory.control.value),
      mode,
      idle_timeout_s: idleTimeout,
      make_room_after_s: makeRoomAfter,
      role: decision.checked ? "decision" : "model",
      args: splitArgs(args.control.value),
    };
  }

  function drawSummary() {
    let b;
    try {
      b = body();
    } catch {
      return;
    }
    const rows = [
      ["Name", b.name],
      ["Engine", ENGINE_NAMES[b.engine] || b.engine],
      ["Model", b.model],
      ["Memory", `${b.memory_gib} GiB`],
      ["Engine arguments", b.args.length ? quoteArgs(b.args) : "none"],
    ];
    if (b.role === "decision") rows.push(["Role", "Decision model"]);
    replace(summary, rows.map(([k, v]) => h("div", [h("dt", k), h("dd", v)])));
  }

  for (const el of [onDemand, alwaysOn, decision]) el.addEventListener("change", () => { drawMode(); drawSummary(); });
  idle.control.addEventListener("input", drawMode);
  back.addEventListener("click", () => {
    step = 1;
    error.hidden = true;
    drawSteps();
    name.control.focus();
  });

  form.addEventListener("submit", async (event) => {
    event.preventDefault();
    error.hidden = true;
    if (step === 1) {
      if (checkStep1() !== true) return;
      step = 2;
      drawSteps();
      drawMode();
      drawSummary();
      (onDemand.checked ? onDemand : alwaysOn).focus();
      return;
    }
    let payload;
    try {
      payload = body();
    } catch (err) {
      fail(err.message, err.control);
      return;
    }
    next.disabled = back.disabled = true;
    next.textContent = "Deploying…";
    try {
      const rec = await api("POST", "deployments", { body: payload });
      const created = rec.deployment || rec;
      if (created && created.id) {
        live.putDeployment(created);
        if (created.not_started && created.mode === "on_demand") {
          notify(`${created.name} was created; it starts on its next request (not now: ${created.not_started})`);
        } else if (created.not_started) {
          notify(`${created.name} was created but not started: ${created.not_started}`, "error");
        } else {
          notify(`${created.name} is deployed and starting.`);
        }
        navigate(`#/deployments/${encodeURIComponent(created.id)}`);
      } else {
        navigate("#/deployments");
      }
    } catch (err) {
      fail(describeError(err));
      if (err.status === 409 && err.code === "name_taken") {
        step = 1;
        drawSteps();
        fail(describeError(err), name.control);
      }
    } finally {
      next.disabled = back.disabled = false;
      if (step === 2) next.textContent = "Deploy";
    }
  });

  // Defaults: the idle timeout from the settings, the mode from the LiteLLM status.
  const settingsReady = (live.state.settings ? Promise.resolve(live.state.settings) : api("GET", "settings"))
    .then((s) => {
      const value = (s && (s.settings || s).ondemand_idle_timeout_s) ?? defaultIdleS;
      defaultIdleS = Number(value);
    })
    .catch((err) => fail(`Could not read the default idle time: ${describeError(err)}`));
  const litellmReady = api("GET", "litellm")
    .then((s) => {
      defaultMode = s.default_mode === "on_demand" ? "on_demand" : "always_on";
      hint = s.hint || (defaultMode === "on_demand" ? null : HINT);
    })
    .catch(() => {
      defaultMode = "always_on";
      hint = HINT;
    });
  Promise.all([settingsReady, litellmReady]).then(() => {
    if (!idle.control.value) idle.control.value = minutes(defaultIdleS);
    if (!onDemand.checked && !alwaysOn.checked) (defaultMode === "on_demand" ? onDemand : alwaysOn).checked = true;
    drawMode();
  });
  drawSteps();
  drawMode();
  return { node, title: "Deploy a model" };
}
