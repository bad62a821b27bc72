// Small pieces several pages share.

import { describeError } from "../api.js";
import { h } from "../dom.js";
import * as live from "../live.js";

/** Run `fn` at most once per `ms`, the last call always honoured (trailing). */
export function throttle(fn, ms) {
  let timer = null;
  let last = 0;
  const wrapped = () => {
    const now = Date.now();
    if (timer !== null) return;
    const wait = Math.max(0, last + ms - now);
    timer = setTimeout(() => {
      timer = null;
      last = Date.now();
      fn();
    }, wait);
  };
  wrapped.cancel = () => {
    if (timer !== null) clearTimeout(timer);
    timer = null;
  };
  return wrapped;
}

const LOGGED_FIELDS = ["state", "mode", "pending_mode", "idle_timeout_s", "model", "memory_bytes", "failures"];

/** Whether a change of a record can have added to the event log (traffic alone does not:
 * in-flight and queue counts change without an audited event, so they need no reload). */
export function loggedChange(before, after) {
  if (!before || !after) return true;
  return LOGGED_FIELDS.some((k) => before[k] !== after[k]);
}

/** The deployment an audit row is about, as a link when it still exists. */
export function auditTarget(row) {
  const target = row.target || "";
  if (!target.startsWith("deployment:")) {
    const words = { settings: "Settings", litellm: "LiteLLM", users: "—", queue: "—" };
    return h("span.muted", words[target] ?? target);
  }
  const id = target.slice("deployment:".length);
  const name = row.deployment || (live.state.deployments.get(id) || {}).name;
  if (live.state.deployments.has(id)) return h("a", { href: `#/deployments/${encodeURIComponent(id)}` }, name || id);
  return h("span", { title: `removed deployment ${id}` }, name || id);
}

/** Who did it, in words. A failed login is nobody's act: it is recorded by the client's
 * address (actor "client:ADDRESS") with the name tried when that is a user's (another name
 * is kept only as a keyed hash: it may be a password typed in the wrong field). */
export function auditActor(row) {
  const actor = row.actor || "";
  if (row.action !== "login_failed") return actor;
  const name = (row.details || {}).name;
  const trying = name ? `trying ${name}` : "trying a name that is no user's";
  return actor.startsWith("client:") ? `${actor.slice("client:".length)}, ${trying}` : trying;
}

/** Disable a button while `work()` runs, and report its failure in `errorEl`. */
export async function busy(button, busyText, work, errorEl) {
  const text = button.textContent;
  button.disabled = true;
  button.setAttribute("aria-busy", "true");
  button.textContent = busyText;
  if (errorEl) errorEl.hidden = true;
  try {
    return await work();
  } catch (err) {
    if (errorEl) {
      errorEl.textContent = describeError(err);
      errorEl.hidden = false;
    }
    return undefined;
  } finally {
    button.disabled = false;
    button.removeAttribute("aria-busy");
    button.textContent = text;
  }
}

/** A modal dialog; resolves with the value `onSubmit` returns, or null when cancelled. */
export function dialog({ title, body, submitText, danger = false, onSubmit }) {
  return new Promise((resolve) => {
    const error = h("p.error", { role: "alert", hidden: true });
    const submit = h(danger ? "button.danger" : "button.primary", { type: "submit" }, submitText);
    const cancel = h("button.secondary", { type: "button" }, "Cancel");
    const titleId = `dlg-${Math.random().toString(36).slice(2)}`;
    const form = h("form", { method: "dialog", novalidate: true }, [
      h("h2", { id: titleId }, title),
      body,
      error,
      h("div.actions", [submit, cancel]),
    ]);
    const dlg = h("dialog", { "aria-labelledby": titleId }, form);
    let settled = false;
    const finish = (value) => {
      if (settled) return;
      settled = true;
      dlg.close();
      dlg.remove();
      resolve(value);
    };
    cancel.addEventListener("click", () => finish(null));
    dlg.addEventListener("cancel", (e) => {
      e.preventDefault();
      finish(null);
    });
    form.addEventListener("submit", async (e) => {
      e.preventDefault();
      const value = await busy(submit, `${submitText}…`, () => onSubmit(), error);
      if (value !== undefined) finish(value);
    });
    document.body.append(dlg);
    dlg.showModal();
    const first = form.querySelector("input, select, textarea") || submit;
    first.focus();
  });
}
