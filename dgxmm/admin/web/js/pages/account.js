// My account: change my own password (every user, viewers too).

import { api } from "../api.js";
import { field, h } from "../dom.js";
import { busy } from "./common.js";

export function render({ notify, user }) {
  const current = field("Current password", h("input", { type: "password", autocomplete: "current-password", id: "pw-current" }));
  const next = field("New password", h("input", { type: "password", autocomplete: "new-password", id: "pw-new" }), "At least 8 characters.");
  const again = field("New password again", h("input", { type: "password", autocomplete: "new-password", id: "pw-again" }));
  const error = h("p.error", { role: "alert", hidden: true });
  const save = h("button.primary", { type: "submit" }, "Change password");
  const form = h("form", { novalidate: true, id: "password-form" }, [current.wrap, next.wrap, again.wrap, error, h("div.actions", save)]);
  form.addEventListener("submit", async (event) => {
    event.preventDefault();
    const done = await busy(save, "Changing…", async () => {
      if (next.control.value !== again.control.value) throw new Error("The new passwords differ.");
      return api("POST", "session/password", { body: { current: current.control.value, password: next.control.value } });
    }, error);
    if (done) {
      form.reset();
      notify("Password changed. Your other sessions have ended.");
    }
  });
  const node = h("section", [
    h("h1", "My account"),
    h("section.card", { "aria-labelledby": "pw-title" }, [h("h2#pw-title", `Password of ${user}`), form]),
  ]);
  return { node, title: "My account" };
}
