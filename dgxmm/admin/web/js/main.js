// The app shell: session, navigation, hash routes, notices.

import { api, describeError, session, setSessionLostHandler } from "./api.js";
import { h, replace } from "./dom.js";
import { tickRelativeTimes } from "./format.js";
import * as live from "./live.js";
import * as audit from "./pages/audit.js";
import * as dashboard from "./pages/dashboard.js";
import * as deployment from "./pages/deployment.js";
import * as deployments from "./pages/deployments.js";
import * as login from "./pages/login.js";
import * as settings from "./pages/settings.js";
import * as users from "./pages/users.js";
import * as account from "./pages/account.js";
import * as wizard from "./pages/wizard.js";

const ROUTES = [
  { pattern: /^\/$/, page: dashboard, nav: "dashboard" },
  { pattern: /^\/deployments$/, page: deployments, nav: "deployments" },
  { pattern: /^\/deploy$/, page: wizard, nav: "deploy", admin: true },
  { pattern: /^\/deployments\/([^/]+)(?:\/(events|logs))?$/, page: deployment, nav: "deployments" },
  { pattern: /^\/audit$/, page: audit, nav: "audit" },
  { pattern: /^\/settings$/, page: settings, nav: "settings" },
  { pattern: /^\/users$/, page: users, nav: "users", admin: true },
  { pattern: /^\/account$/, page: account, nav: "account" },
];

const main = document.getElementById("main");
const header = document.getElementById("top");
const notices = document.getElementById("notices");

let current = null; // {destroy}
let renderSeq = 0;

export function isAdmin() {
  return session.role === "admin";
}

export function navigate(hash) {
  if (location.hash === hash) route();
  else location.hash = hash;
}

/** A short message in the notice area (announced to screen readers). */
export function notify(text, kind = "info") {
  const close = h("button.link", { type: "button", "aria-label": "Dismiss" }, "×");
  const note = h(`div.notice.notice-${kind}`, { role: kind === "error" ? "alert" : "status" }, [
    h("span", text),
    close,
  ]);
  close.addEventListener("click", () => note.remove());
  notices.append(note);
  if (kind !== "error") setTimeout(() => note.remove(), 6000);
  while (notices.children.length > 4) notices.firstElementChild.remove();
}

function parseHash() {
  const raw = location.hash.replace(/^#/, "") || "/";
  const [path, queryString] = raw.split("?");
  return { path: path || "/", query: new URLSearchParams(queryString || "") };
}

function renderHeader(activeNav) {
  if (!session.user) {
    replace(header, h("div.bar", h("span.brand", "DGXMM")));
    return;
  }
  const link = (nav, href, text) =>
    h(
      "a",
      { href, class: nav === activeNav ? "active" : "", "aria-current": nav === activeNav ? "page" : null },
      text,
    );
  const links = [
    link("dashboard", "#/", "Dashboard"),
    link("deployments", "#/deployments", "Deployments"),
    isAdmin() ? link("deploy", "#/deploy", "Deploy") : null,
    link("audit", "#/audit", "Audit log"),
    link("settings", "#/settings", "Settings"),
    isAdmin() ? link("users", "#/users", "Users") : null,
  ];
  const conn = h(
    "span.conn",
    {
      id: "conn",
      title: "Live updates",
      class: live.state.connected ? "conn on" : "conn off",
    },
    live.state.connected ? "Live" : "Reconnecting…",
  );
  const logout = h("button.secondary", { type: "button", id: "logout" }, "Log out");
  logout.addEventListener("click", doLogout);
  replace(
    header,
    h("div.bar", [
      h("a.brand", { href: "#/" }, "DGXMM"),
      h("nav", { "aria-label": "Main" }, h("ul", links.filter(Boolean).map((a) => h("li", a)))),
      h("div.who", [
        conn,
        h("a", { id: "whoami", href: "#/account", title: "My account" }, `${session.user} (${session.role})`),
        logout,
      ]),
    ]),
  );
}

live.subscribe((kind, connected) => {
  if (kind !== "connection") return;
  const conn = document.getElementById("conn");
  if (conn) {
    conn.className = connected ? "conn on" : "conn off";
    conn.textContent = connected ? "Live" : "Reconnecting…";
  }
});

async function doLogout() {
  try {
    await api("POST", "logout", { quietAuth: true });
  } catch (err) {
    if (err.status !== 401) notify(describeError(err), "error");
  }
  endSession();
  navigate("#/login");
}

function endSession() {
  session.user = session.role = session.csrf = null;
  live.reset();
}

async function sessionAlive() {
  try {
    await api("GET", "session", { quietAuth: true });
    return true;
  } catch (err) {
    if (err.status === 401) {
      endSession();
      notify("Your session has ended. Log in again.", "error");
      toLogin();
      return false;
    }
    return true; // unreachable for now: keep trying
  }
}

/** Back to the login page, coming back here afterwards. */
function toLogin() {
  const here = location.hash.replace(/^#/, "");
  const next = here && !here.startsWith("/login") ? `?next=${encodeURIComponent(here)}` : "";
  navigate(`#/login${next}`);
}

setSessionLostHandler(() => {
  if (!session.user) return;
  endSession();
  notify("Your session has ended. Log in again.", "error");
  toLogin();
});

/** After a login (or a session found at start-up). */
export function startSession(data) {
  session.user = data.user;
  session.role = data.role;
  session.csrf = data.csrf_token;
  live.connect(sessionAlive);
}

async function route() {
  const seq = ++renderSeq;
  if (current && current.destroy) current.destroy();
  current = null;
  const { path, query } = parseHash();
  if (!session.user) {
    renderHeader(null);
    const next = path === "/login" ? query.get("next") || "" : `${path}${query.toString() ? `?${query}` : ""}`;
    show(login.render({ next, notify, navigate, startSession }), "Log in");
    return;
  }
  if (path === "/login") {
    navigate(query.get("next") ? `#${query.get("next")}` : "#/");
    return;
  }
  const found = ROUTES.map((r) => ({ r, m: r.pattern.exec(path) })).find((x) => x.m);
  if (!found) {
    renderHeader(null);
    show(
      { node: h("section", [h("h1", { tabindex: "-1" }, "Page not found"), h("p", h("a", { href: "#/" }, "Go to the dashboard"))]) },
      "Not found",
    );
    return;
  }
  renderHeader(found.r.nav);
  if (found.r.admin && !isAdmin()) {
    show(
      {
        node: h("section", [
          h("h1", { tabindex: "-1" }, "Administrators only"),
          h("p", "Your account can look at deployments but not deploy new ones."),
        ]),
      },
      "Administrators only",
    );
    return;
  }
  const ctx = {
    params: found.m.slice(1),
    query,
    notify,
    navigate,
    isAdmin: isAdmin(),
    user: session.user,
  };
  const view = found.r.page.render(ctx);
  if (seq !== renderSeq) {
    if (view.destroy) view.destroy();
    return;
  }
  show(view, view.title);
}

function show(view, title) {
  current = view;
  replace(main, view.node);
  document.title = title ? `${title} · DGXMM` : "DGXMM";
  const heading = main.querySelector("h1");
  if (heading && document.activeElement !== heading && !main.contains(document.activeElement)) {
    heading.setAttribute("tabindex", "-1");
    heading.focus({ preventScroll: true });
  }
}

async function boot() {
  // The skip link must not change the hash (that is the router's).
  document.querySelector(".skip").addEventListener("click", (event) => {
    event.preventDefault();
    main.focus();
  });
  try {
    const data = await api("GET", "session", { quietAuth: true });
    startSession(data);
  } catch (err) {
    if (err.status !== 401) notify(describeError(err), "error");
  }
  window.addEventListener("hashchange", route);
  setInterval(() => tickRelativeTimes(main), 10000);
  route();
}

boot();
