// Log in with a DGXMM user name and password.

import { api, describeError } from "../api.js";
import { field, h } from "../dom.js";

export function render({ next, navigate, startSession }) {
  const name = field("Name", h("input", { type: "text", name: "name", autocomplete: "username", required: true }));
  const password = field(
    "Password",
    h("input", { type: "password", name: "password", autocomplete: "current-password", required: true }),
  );
  const error = h("p.error", { role: "alert", id: "login-error", hidden: true });
  const submit = h("button.primary", { type: "submit" }, "Log in");
  const form = h("form.card.login", { novalidate: true, "aria-labelledby": "login-title" }, [
    h("h1#login-title", "Log in to DGXMM"),
    name.wrap,
    password.wrap,
    error,
    h("div.actions", submit),
  ]);
  form.addEventListener("submit", async (event) => {
    event.preventDefault();
    error.hidden = true;
    if (!name.control.value.trim() || !password.control.value) {
      error.textContent = "Enter your name and password.";
      error.hidden = false;
      (name.control.value.trim() ? password.control : name.control).focus();
      return;
    }
    submit.disabled = true;
    submit.textContent = "Logging in…";
    try {
      const data = await api("POST", "login", {
        body: { name: name.control.value.trim(), password: password.control.value },
        quietAuth: true,
      });
      const who = data.user ? data : await api("GET", "session");
      startSession({ user: who.user, role: who.role, csrf_token: data.csrf_token || who.csrf_token });
      navigate(next ? `#${next}` : "#/");
    } catch (err) {
      error.textContent = describeError(err);
      error.hidden = false;
      password.control.select();
      password.control.focus();
    } finally {
      submit.disabled = false;
      submit.textContent = "Log in";
    }
  });
  queueMicrotask(() => name.control.focus());
  return { node: h("section.login-page", form), title: "Log in" };
}
