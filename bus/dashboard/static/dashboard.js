// The idembus dashboard's one script, shipped with the package (no build step, no CDN).
// It refreshes the overview in place and follows the live stream. What comes from a
// message reaches the page as text (textContent), never as markup; the overview's HTML
// is the server's, escaped there.
"use strict";

function autosubmit() {
  for (const select of document.querySelectorAll("select[data-autosubmit]")) {
    select.addEventListener("change", () => select.form.submit());
  }
}

function refresh(element) {
  const interval = Number(element.dataset.interval) || 5000;
  const load = async () => {
    if (document.hidden) return;
    try {
      const response = await fetch(element.dataset.refresh, {
        credentials: "same-origin", headers: { Accept: "text/html" }, cache: "no-store",
      });
      if (!response.ok) throw new Error(`HTTP ${response.status}`);
      element.innerHTML = await response.text();  // the server's escaped HTML
      element.dataset.updated = new Date().toISOString();
      element.classList.remove("stale");
    } catch (error) {
      element.classList.add("stale");
    }
  };
  setInterval(load, interval);
}

function cell(text, code) {
  const td = document.createElement("td");
  const inner = code ? document.createElement("code") : td;
  inner.textContent = text;
  if (code) td.appendChild(inner);
  return td;
}

function addEvent(table, event) {
  let data;
  try { data = JSON.parse(event.data); } catch (error) { return; }
  if (!event.id || data === null || typeof data !== "object") return;
  const body = table.tBodies[0];
  const empty = body.querySelector("td.empty");
  if (empty) empty.parentElement.remove();
  const row = document.createElement("tr");
  const aggregate = data.aggregate_type && data.aggregate_id
    ? `${data.aggregate_type}/${data.aggregate_id}` : "-";
  const shown = typeof data.body === "string" ? data.body : JSON.stringify(data.body);
  const recorded = data.recorded_at
    ? `${String(data.recorded_at).replace("T", " ").slice(0, 19)} UTC` : "-";
  row.append(cell(event.id), cell(recorded),
             cell(event.type, true), cell(aggregate, true),
             cell((data.parents || []).join(", ") || "-", true), cell(shown, true));
  row.lastChild.firstChild.className = "body";
  row.className = "new";
  body.insertBefore(row, body.firstChild);
  const most = Number(table.dataset.rows) || 200;
  while (body.rows.length > most) body.deleteRow(body.rows.length - 1);
}

// Server-Sent Events read with fetch: event names are message types, which EventSource
// cannot listen for without knowing them all.
function follow(table) {
  const state = document.getElementById("stream-state");
  const url = new URL(table.dataset.stream, window.location.href);
  const say = (text, kind) => { if (state) { state.textContent = text; state.className = `badge ${kind}`; } };
  const connect = async () => {
    try {
      const response = await fetch(url, {
        credentials: "same-origin", headers: { Accept: "text/event-stream" }, cache: "no-store",
      });
      if (!response.ok) throw new Error(`HTTP ${response.status}`);
      say("live", "ok");
      const reader = response.body.getReader();
      const decoder = new TextDecoder();
      let buffer = "";
      for (;;) {
        const { value, done } = await reader.read();
        if (done) break;
        buffer += decoder.decode(value, { stream: true });
        let end;
        while ((end = buffer.indexOf("\n\n")) >= 0) {
          const block = buffer.slice(0, end);
          buffer = buffer.slice(end + 2);
          const event = { id: "", type: "message", data: "" };
          for (const line of block.split("\n")) {
            const colon = line.indexOf(":");
            if (colon <= 0) continue;
            const field = line.slice(0, colon);
            const text = line.slice(colon + 1).replace(/^ /, "");
            if (field === "id") event.id = text;
            else if (field === "event") event.type = text;
            else if (field === "data") event.data += text;
          }
          if (event.id) {
            url.searchParams.set("last_event_id", event.id);  // resume after it
            addEvent(table, event);
          }
        }
      }
    } catch (error) {
      // reconnect below
    }
    say("reconnecting…", "warn");
    setTimeout(connect, 2000);
  };
  connect();
}

document.addEventListener("DOMContentLoaded", () => {
  autosubmit();
  for (const element of document.querySelectorAll("[data-refresh]")) refresh(element);
  for (const table of document.querySelectorAll("table[data-stream]")) follow(table);
});
