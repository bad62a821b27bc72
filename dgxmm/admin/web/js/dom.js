// A tiny DOM builder: h("tag.class#id", {attrs}, ...children). No framework, no build step.

export function h(spec, attrs, ...children) {
  const [tagAndClasses, id] = spec.split("#");
  const [tag, ...classes] = tagAndClasses.split(".");
  const el = document.createElement(tag || "div");
  if (id) el.id = id;
  if (classes.length) el.className = classes.join(" ");
  if (attrs !== null && attrs !== undefined) {
    if (typeof attrs !== "object" || attrs instanceof Node || Array.isArray(attrs)) {
      children.unshift(attrs);
    } else {
      setAttrs(el, attrs);
    }
  }
  append(el, children);
  return el;
}

function setAttrs(el, attrs) {
  for (const [key, value] of Object.entries(attrs)) {
    if (value === undefined || value === null || value === false) continue;
    if (key.startsWith("on") && typeof value === "function") {
      el.addEventListener(key.slice(2).toLowerCase(), value);
    } else if (key === "class") {
      el.className = value;
    } else if (key === "dataset") {
      Object.assign(el.dataset, value);
    } else if (key === "value") {
      el.value = value;
    } else if (key === "checked" || key === "disabled" || key === "selected") {
      el[key] = Boolean(value);
    } else if (value === true) {
      el.setAttribute(key, "");
    } else {
      el.setAttribute(key, String(value));
    }
  }
}

export function append(el, children) {
  for (const child of children.flat(Infinity)) {
    if (child === null || child === undefined || child === false) continue;
    el.append(child instanceof Node ? child : document.createTextNode(String(child)));
  }
  return el;
}

/** Replace every child of `el` with `children`. */
export function replace(el, ...children) {
  el.replaceChildren();
  return append(el, children);
}

let uid = 0;
/** A fresh id for label/control pairs. */
export function newId(prefix = "f") {
  uid += 1;
  return `${prefix}-${uid}`;
}

/** A labelled form field: returns {wrap, control}. */
export function field(label, control, hint) {
  if (!control.id) control.id = newId();
  const parts = [h("label", { for: control.id }, label), control];
  if (hint) {
    const hintEl = h("p.hint", { id: `${control.id}-hint` }, hint);
    control.setAttribute("aria-describedby", hintEl.id);
    parts.push(hintEl);
  }
  return { wrap: h("div.field", parts), control };
}
