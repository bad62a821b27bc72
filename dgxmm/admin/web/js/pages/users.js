// Users and API tokens (administrators): list, add, change role, reset password, remove;
// create tokens (shown once), list them with their last use, revoke them.

import { api, describeError } from "../api.js";
import { field, h, replace } from "../dom.js";
import { dateTime, relativeTime } from "../format.js";
import { busy, dialog } from "./common.js";

const DAY_S = 86400;

export function render({ notify, user: me }) {
  const usersBody = h("div", { id: "users" }, h("p.muted", "Loading…"));
  const tokensBody = h("div", { id: "tokens" }, h("p.muted", "Loading…"));
  const node = h("section", [
    h("h1", "Users and API tokens"),
    h("section.card", { "aria-labelledby": "users-title" }, [h("h2#users-title", "Users"), usersBody, addUserForm()]),
    h("section.card", { "aria-labelledby": "tokens-title" }, [h("h2#tokens-title", "API tokens"), tokensBody, tokenForm()]),
  ]);

  async function load() {
    try {
      const [u, t] = await Promise.all([api("GET", "users"), api("GET", "tokens")]);
      drawUsers(u.users);
      drawTokens(t.tokens);
    } catch (err) {
      replace(usersBody, h("p.error", { role: "alert" }, describeError(err)));
    }
  }

  // --- users -----------------------------------------------------------------------------
  function drawUsers(rows) {
    const body = rows.map((u) => {
      const role = h(
        "select",
        { "aria-label": `Role of ${u.name}`, dataset: { user: u.name } },
        ["admin", "viewer"].map((r) => h("option", { value: r, selected: r === u.role }, r)),
      );
      role.addEventListener("change", async () => {
        try {
          await api("PATCH", `users/${encodeURIComponent(u.name)}`, { body: { role: role.value } });
          notify(`${u.name} is now ${role.value === "admin" ? "an admin" : "a viewer"}.`);
        } catch (err) {
          notify(describeError(err), "error");
        }
        load();
      });
      const reset = h("button.secondary", { type: "button" }, "Reset password");
      reset.addEventListener("click", () => resetPassword(u.name));
      const remove = h("button.danger", { type: "button", dataset: { remove: u.name } }, "Remove");
      remove.addEventListener("click", () => removeUser(u.name));
      return h("tr", { dataset: { user: u.name } }, [
        h("th", { scope: "row" }, u.name === me ? `${u.name} (you)` : u.name),
        h("td", role),
        h("td", u.created_at ? dateTime(u.created_at) : "—"),
        h("td.num", String(u.tokens)),
        h("td", h("div.actions", [reset, remove])),
      ]);
    });
    replace(
      usersBody,
      h("div.table-wrap", h("table", [
        h("thead", h("tr", ["Name", "Role", "Created", "Tokens", ""].map((t) => h("th", { scope: "col" }, t)))),
        h("tbody", body),
      ])),
    );
  }

  function addUserForm() {
    const name = field("Name", h("input", { type: "text", autocomplete: "off", spellcheck: "false", id: "new-user-name" }));
    const role = field("Role", h("select", { id: "new-user-role" }, [h("option", { value: "viewer" }, "viewer"), h("option", { value: "admin" }, "admin")]));
    const password = field("Password", h("input", { type: "password", autocomplete: "new-password", id: "new-user-password" }), "At least 8 characters.");
    const error = h("p.error", { role: "alert", hidden: true });
    const add = h("button.primary", { type: "submit" }, "Add user");
    const form = h("form", { novalidate: true, id: "add-user" }, [h("h3", "Add a user"), name.wrap, role.wrap, password.wrap, error, h("div.actions", add)]);
    form.addEventListener("submit", async (event) => {
      event.preventDefault();
      const done = await busy(add, "Adding…", () =>
        api("POST", "users", { body: { name: name.control.value.trim(), role: role.control.value, password: password.control.value } }),
        error,
      );
      if (done) {
        notify(`Added ${done.name}.`);
        form.reset();
        load();
      }
    });
    return form;
  }

  async function resetPassword(name) {
    const password = field("New password", h("input", { type: "password", autocomplete: "new-password" }), "At least 8 characters. Their sessions end.");
    const done = await dialog({
      title: `Reset the password of ${name}`,
      body: password.wrap,
      submitText: "Reset password",
      onSubmit: () => api("PATCH", `users/${encodeURIComponent(name)}`, { body: { password: password.control.value } }),
    });
    if (done) notify(`The password of ${name} was reset; their sessions have ended.`);
  }

  async function removeUser(name) {
    const done = await dialog({
      title: `Remove ${name}?`,
      body: h("p", `${name} is logged out at once and their API tokens stop working.`),
      submitText: "Remove user",
      danger: true,
      onSubmit: () => api("DELETE", `users/${encodeURIComponent(name)}`),
    });
    if (done) {
      notify(`Removed ${name}.`);
      load();
    }
  }

  // --- tokens ----------------------------------------------------------------------------
  function drawTokens(rows) {
    if (!rows.length) {
      replace(tokensBody, h("p.muted", "No API tokens."));
      return;
    }
    const body = rows.map((t) => {
      const revoke = h("button.danger", { type: "button", dataset: { revoke: t.token_id } }, "Revoke");
      revoke.addEventListener("click", () => revokeToken(t));
      return h("tr", { dataset: { token: t.token_id } }, [
        h("th", { scope: "row" }, t.name || h("span.muted", "(no name)")),
        h("td", h("code", t.token_id)),
        h("td", t.user),
        h("td", t.role),
        h("td", t.expired ? "expired" : t.expires_at ? dateTime(t.expires_at) : "never"),
        h("td", relativeTime(t.last_used_at)),
        h("td", revoke),
      ]);
    });
    replace(
      tokensBody,
      h("div.table-wrap", h("table", [
        h("thead", h("tr", ["Name", "Id", "User", "Role", "Expires", "Last used", ""].map((x) => h("th", { scope: "col" }, x)))),
        h("tbody", body),
      ])),
    );
  }

  function tokenForm() {
    const label = field("Name", h("input", { type: "text", id: "token-name", placeholder: "e.g. prometheus" }));
    const owner = field("Acts as", h("input", { type: "text", id: "token-user", value: me, spellcheck: "false" }), "A user name; the token has that user's role.");
    const kind = field("Access", h("select", { id: "token-role" }, [
      h("option", { value: "" }, "The user's role"),
      h("option", { value: "metrics" }, "Metrics only (reads /metrics and nothing else)"),
    ]));
    const days = field("Expires after (days)", h("input", { type: "number", min: "1", max: "3650", step: "1", id: "token-days" }), "Empty: never.");
    const error = h("p.error", { role: "alert", hidden: true });
    const create = h("button.primary", { type: "submit" }, "Create token");
    const form = h("form", { novalidate: true, id: "create-token" }, [h("h3", "Create a token"), label.wrap, owner.wrap, kind.wrap, days.wrap, error, h("div.actions", create)]);
    form.addEventListener("submit", async (event) => {
      event.preventDefault();
      const body = { name: label.control.value.trim(), user: owner.control.value.trim() || me };
      if (kind.control.value) body.role = kind.control.value;
      if (days.control.value) body.expires_in_s = Number(days.control.value) * DAY_S;
      const made = await busy(create, "Creating…", () => api("POST", "tokens", { body }), error);
      if (!made) return;
      form.reset();
      owner.control.value = me;
      load();
      await dialog({
        title: "Your new API token",
        body: h("div", [
          h("p", "Copy it now: it is shown only once."),
          h("input", { type: "text", readonly: true, value: made.token, id: "new-token", "aria-label": "The new token" }),
        ]),
        submitText: "Done",
        onSubmit: () => true,
      });
    });
    return form;
  }

  async function revokeToken(t) {
    const done = await dialog({
      title: `Revoke ${t.name || t.token_id}?`,
      body: h("p", "It stops working at once."),
      submitText: "Revoke token",
      danger: true,
      onSubmit: () => api("DELETE", `tokens/${encodeURIComponent(t.token_id)}`),
    });
    if (done) {
      notify("Token revoked.");
      load();
    }
  }

  load();
  return { node, title: "Users" };
}
