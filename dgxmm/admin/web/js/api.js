// The admin API: JSON under <app>/api/, the session's CSRF token on every mutation, and the
// API's errors turned into sentences a person can act on.

export const API_BASE = new URL("api/", document.baseURI);

export const session = { user: null, role: null, csrf: null };

/** Called when any call finds the session gone (set by main.js). */
let onSessionLost = () => {};
export function setSessionLostHandler(fn) {
  onSessionLost = fn;
}

export class ApiError extends Error {
  constructor(status, code, message, extra = {}) {
    super(message);
    this.status = status;
    this.code = code;
    this.extra = extra;
  }
}

export function apiUrl(path, query) {
  const url = new URL(path.replace(/^\//, ""), API_BASE);
  if (query) {
    for (const [key, value] of Object.entries(query)) {
      if (value !== undefined && value !== null && value !== "") url.searchParams.set(key, value);
    }
  }
  return url;
}

const MUTATING = new Set(["POST", "PATCH", "PUT", "DELETE"]);

export async function api(method, path, { body, query, quietAuth = false } = {}) {
  const headers = { accept: "application/json" };
  if (body !== undefined) headers["content-type"] = "application/json";
  if (MUTATING.has(method) && session.csrf) headers["x-csrf-token"] = session.csrf;
  let response;
  try {
    response = await fetch(apiUrl(path, query), {
      method,
      headers,
      body: body === undefined ? undefined : JSON.stringify(body),
      credentials: "same-origin",
      cache: "no-store",
    });
  } catch {
    throw new ApiError(0, "unreachable", "DGXMM did not answer");
  }
  let data = null;
  const text = await response.text();
  if (text) {
    try {
      data = JSON.parse(text);
    } catch {
      data = null;
    }
  }
  if (!response.ok) {
    const err = data && typeof data === "object" && data.error ? data.error : {};
    const error = new ApiError(
      response.status,
      typeof err === "object" ? err.code || "" : String(err),
      (typeof err === "object" ? err.message : String(err)) || response.statusText || "",
      { retryAfter: response.headers.get("retry-after") },
    );
    if (response.status === 401 && !quietAuth) onSessionLost();
    throw error;
  }
  return data;
}

const FIELD_LABELS = {
  name: "Name",
  engine: "Engine",
  model: "Model",
  memory_gib: "Memory",
  memory_bytes: "Memory",
  args: "Engine arguments",
  mode: "Mode",
  idle_timeout_s: "Idle time before sleeping",
  role: "Role",
  ondemand_idle_timeout_s: "Idle minutes before sleeping",
  ondemand_queue_timeout_s: "Queue timeout",
  ondemand_max_queued: "Most requests waiting",
  make_room_after_s: "Make room after (seconds)",
  ondemand_make_room_after_s: "Make room after (seconds)",
};

/** Deployment names the page knows (live.js keeps it): a message that begins with one keeps
 * it as it is written ("my-sim needs 6 GiB", not "My-sim"). */
export const knownNames = new Set();

function sentence(text) {
  const trimmed = String(text || "").trim();
  if (!trimmed) return "";
  const word = trimmed.split(/[\s:,]/, 1)[0];
  const keep = knownNames.has(word) || /[-_./0-9]/.test(word);
  const first = keep ? trimmed : trimmed[0].toUpperCase() + trimmed.slice(1);
  return /[.!?)]$/.test(first) ? first : `${first}.`;
}

/** "name: letters…" -> "Name: letters…." */
function fieldMessage(message) {
  const match = /^([a-z_.]+): (.*)$/s.exec(message || "");
  if (match && FIELD_LABELS[match[1]]) return `${FIELD_LABELS[match[1]]}: ${match[2]}`;
  return message;
}

/** Words for an error, whatever threw it. */
export function describeError(error) {
  if (!(error instanceof ApiError)) {
    return sentence(error && error.message ? error.message : "Something went wrong");
  }
  const { status, code, message } = error;
  switch (code) {
    case "unreachable":
      return "DGXMM did not answer. Check that it is running and that this computer can reach it, then try again.";
    case "invalid_credentials":
      return "That name and password do not match. Check them and try again.";
    case "too_many_attempts": {
      const wait = Number(error.extra.retryAfter);
      const when = Number.isFinite(wait) && wait > 0 ? `in ${Math.ceil(wait)} seconds` : "later";
      return `Too many failed logins. Try again ${when}.`;
    }
    case "csrf_failed":
      return "This page's security token is out of date. Reload the page and try again.";
    case "session_expired":
    case "unauthenticated":
      return "Your session has ended. Log in again.";
    case "insufficient_memory":
      return `There is not enough free memory for that right now. ${sentence(message)}`;
    case "name_taken":
      return "A deployment with that name already exists. Choose another name.";
    case "wrong_password":
      return "That is not your current password.";
    case "decision_model_always_on":
      return "The decision model is always on; it cannot be on demand.";
    default:
      break;
  }
  if (status === 403) {
    return "Your account can only look, not change things. Ask an administrator to do this.";
  }
  if (status === 404) return sentence(message || "Not found");
  if (status === 409) return sentence(message || "That cannot be done in the current state");
  if (status === 422 || status === 400) return sentence(fieldMessage(message) || "Check the form");
  if (status >= 500) {
    return `DGXMM could not do that: ${sentence(message || "an internal error")} Try again; if it keeps happening, look at DGXMM's log.`;
  }
  return sentence(message || `Request failed (HTTP ${status})`);
}
