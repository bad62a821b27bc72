// The chart library (uPlot), served by DGXMM at /dgxmm/vendor/uplot/ (dgxmm/admin/vendor.py):
// loaded once, on the first chart; when the server lacks it, a clear message instead of a chart.

import { h } from "./dom.js";

const BASE = "/dgxmm/vendor/uplot/";
let loading = null;

/** A promise of the uPlot constructor; rejects with an Error saying how to install it. */
export function loadUPlot() {
  if (window.uPlot) return Promise.resolve(window.uPlot);
  if (loading) return loading;
  loading = new Promise((resolve, reject) => {
    const css = document.createElement("link");
    css.rel = "stylesheet";
    css.href = `${BASE}uPlot.min.css`;
    document.head.append(css);
    const script = document.createElement("script");
    script.src = `${BASE}uPlot.iife.min.js`;
    script.onload = () => (window.uPlot ? resolve(window.uPlot) : reject(missing()));
    script.onerror = () => reject(missing());
    document.head.append(script);
  });
  loading.catch(() => {
    loading = null; // try again on the next chart
  });
  return loading;
}

function missing() {
  return new Error(
    "The chart library (uPlot) is not installed on this server: run scripts/fetch-web-vendor there, then reload.",
  );
}

/** The element shown in a chart's place when the library is missing. */
export function chartUnavailable(err) {
  return h("p.chart-missing", { role: "status" }, err.message);
}
