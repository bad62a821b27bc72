// The live picture: deployments, memory, queue and settings, kept current by the admin API's
// event stream (GET api/events/stream). Pages read from here and subscribe to changes.

import { api, apiUrl, knownNames } from "./api.js";

export const state = {
  deployments: new Map(), // id -> record
  memory: null,
  queue: null,
  settings: null,
  connected: false,
  loaded: false,
};

const listeners = new Set();

/** `fn(kind, payload)`; kind is "snapshot", "deployment", "removed", "memory", "queue",
 * "settings" or "connection". Returns the unsubscribe function. */
export function subscribe(fn) {
  listeners.add(fn);
  return () => listeners.delete(fn);
}

function emit(kind, payload) {
  for (const fn of [...listeners]) {
    try {
      fn(kind, payload);
    } catch (err) {
      console.error("live listener failed", err);
    }
  }
}

export function deploymentsInOrder() {
  return [...state.deployments.values()].sort((a, b) => a.created_at - b.created_at);
}

/** A record the page got from a call (a POST's answer, say): apply it at once. */
export function putDeployment(rec) {
  state.deployments.set(rec.id, rec);
  knownNames.add(rec.name);
  emit("deployment", rec);
}

export function dropDeployment(id) {
  if (state.deployments.delete(id)) emit("removed", { id });
}

let source = null;
let retryTimer = null;
let checkSession = async () => true;

function applySnapshot(data) {
  state.deployments = new Map(data.deployments.map((d) => [d.id, d]));
  for (const d of data.deployments) knownNames.add(d.name);
  state.memory = data.memory;
  state.queue = data.queue;
  state.settings = data.settings;
  state.loaded = true;
  emit("snapshot", data);
}

function setConnected(value) {
  if (state.connected !== value) {
    state.connected = value;
    emit("connection", value);
  }
}

function parse(event) {
  try {
    return JSON.parse(event.data);
  } catch {
    return null;
  }
}

/** Open the stream (once per login). `sessionAlive()` tells whether to reconnect. */
export function connect(sessionAlive) {
  checkSession = sessionAlive;
  disconnect();
  open();
}

function open() {
  const es = new EventSource(apiUrl("events/stream"), { withCredentials: true });
  source = es;
  es.addEventListener("open", () => setConnected(true));
  es.addEventListener("snapshot", (e) => {
    const data = parse(e);
    if (data) applySnapshot(data);
  });
  es.addEventListener("deployment", (e) => {
    const rec = parse(e);
    if (rec) putDeployment(rec);
  });
  es.addEventListener("removed", (e) => {
    const data = parse(e);
    if (data) dropDeployment(data.id);
  });
  for (const kind of ["memory", "queue", "settings"]) {
    es.addEventListener(kind, (e) => {
      const data = parse(e);
      if (data) {
        state[kind] = data;
        emit(kind, data);
      }
    });
  }
  es.addEventListener("error", () => {
    setConnected(false);
    if (es.readyState === EventSource.CLOSED && source === es) {
      // The server refused the stream (the session ended, or too many streams): find out
      // which before trying again, so a logged-out tab stops knocking.
      source = null;
      retryTimer = setTimeout(async () => {
        retryTimer = null;
        if (await checkSession()) open();
      }, 3000);
    }
  });
}

export function disconnect() {
  if (retryTimer !== null) {
    clearTimeout(retryTimer);
    retryTimer = null;
  }
  if (source !== null) {
    source.close();
    source = null;
  }
  setConnected(false);
}

/** Load without the stream (first paint, or a page that needs fresh numbers now). */
export async function refreshDeployments() {
  const data = await api("GET", "deployments");
  const list = Array.isArray(data) ? data : data.deployments || [];
  state.deployments = new Map(list.map((d) => [d.id, d]));
  state.loaded = true;
  emit("snapshot", { deployments: list });
  return list;
}

export function reset() {
  disconnect();
  state.deployments = new Map();
  state.memory = null;
  state.queue = null;
  state.settings = null;
  state.loaded = false;
}
