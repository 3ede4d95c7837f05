// The queue page's controls: pause, resume and cancel a job, requeue a failed or cancelled one,
// yield the devices. Each is a POST to the JSON API with the page's CSRF value; the table is read
// again every two seconds. A job's name links to its run's page once it trained.
"use strict";
(function () {
  const table = document.getElementById("jobs");
  if (!table) return;
  const csrf = document.querySelector('meta[name="ember-csrf"]').content;
  const message = document.getElementById("queue-message");
  const signedIn = table.dataset.signedIn === "true";
  const final = table.dataset.final.split(" ");  // a finished job takes no more changes

  async function post(path, body) {
    const r = await fetch(path, {
      method: "POST", credentials: "same-origin",
      headers: { "Content-Type": "application/json", "X-Ember-CSRF": csrf },
      body: JSON.stringify(body || {}),
    });
    const data = await r.json();
    if (!r.ok) throw new Error((data.error && data.error.message) || r.statusText);
    return data;
  }

  function cell(text, cls) {
    const td = document.createElement("td");
    td.textContent = text;
    if (cls) td.className = cls;
    return td;
  }

  function row(j) {
    const tr = document.createElement("tr");
    tr.dataset.job = j.id;
    let note = j.state === "failed" ? `failed: ${j.cause || "no cause recorded"}; its output: ${j.log} (ember logs ${j.name})`
      : j.hold ? `held: ${j.hold}` : j.pause ? `pause: ${j.pause}` : "";
    if (j.waiting.length) note += " " + j.waiting.join("; ");
    const name = cell("", "run");
    if (j.run) {
      const a = document.createElement("a");
      a.href = `/runs/${encodeURIComponent(j.run)}`; a.textContent = j.name;
      name.append(a);
    } else name.append(j.name);
    const folder = document.createElement("div");
    folder.className = "sub"; folder.textContent = j.out;
    name.append(folder);
    tr.append(cell(j.id), name, cell(j.state, "state"), cell(j.priority, "n"), cell(j.devices.join(",") || "-"),
              cell(`${j.step}/${j.max_steps}`), cell(j.goodput === null ? "-" : `${(100 * j.goodput).toFixed(1)}%`, "n"),
              cell(note, "note"));
    const actions = cell("", "actions");
    // A finished job takes no pause, resume or cancel (shown off); a failed or cancelled one is requeued.
    const verbs = ["pause", "resume", "cancel", ...(["failed", "cancelled"].includes(j.state) ? ["requeue"] : [])];
    for (const a of verbs) {
      const off = final.includes(j.state) && a !== "requeue";
      const b = document.createElement("button");
      b.type = "button"; b.dataset.action = a; b.textContent = a; b.disabled = !signedIn || off;
      if (off) b.title = `the job is ${j.state}`;
      actions.append(b);
    }
    tr.append(actions);
    return tr;
  }

  async function refresh() {
    const r = await fetch("/api/jobs", { credentials: "same-origin" });
    if (!r.ok) return;
    const jobs = await r.json();
    const body = table.tBodies[0];
    body.replaceChildren(...jobs.map(row));
    table.dataset.refreshed = String(Date.now());
    // owner.toml's state: an error (the rules before it hold) or changes waiting for a restart.
    const owner = await fetch("/api/owner", { credentials: "same-origin" });
    if (!owner.ok) return;
    const notes = (await owner.json()).notes.map(n => {
      const p = document.createElement("p");
      p.className = "error";
      p.textContent = n;
      return p;
    });
    document.getElementById("owner-rules").replaceChildren(...notes);
  }

  table.addEventListener("click", async e => {
    const b = e.target.closest("button[data-action]");
    if (!b) return;
    const job = b.closest("tr").dataset.job;
    try {
      const j = await post(`/api/jobs/${encodeURIComponent(job)}/${b.dataset.action}`);
      message.textContent = `job ${j.id} ${j.name}: ${j.state}${j.hold ? ", held: " + j.hold : ""}`;
      await refresh();
    } catch (err) { message.textContent = err.message; }
  });

  const form = document.getElementById("yield-form");
  form.addEventListener("submit", async e => {
    e.preventDefault();
    message.textContent = "yielding: waiting for every job to checkpoint and leave the devices…";
    try {
      const r = await post("/api/yield", { seconds: 60 * Number(document.getElementById("yield-minutes").value) });
      message.textContent = `devices free after ${r.freed_after_seconds.toFixed(2)} s`;
      document.getElementById("yielding").textContent = "training held: ember yield";
    } catch (err) { message.textContent = err.message; }
  });
  document.getElementById("release").addEventListener("click", async () => {
    try {
      await post("/api/yield", { release: true });
      message.textContent = "yield released: jobs may start again";
      document.getElementById("yielding").textContent = "";
    } catch (err) { message.textContent = err.message; }
  });

  setInterval(() => refresh().catch(() => {}), 2000);
})();
