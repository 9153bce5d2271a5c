// bench/exec.mjs N BASE_URL SANDBOX_ID API_KEY — Node's fetch doing a no-op exec N times the way
// the official SDK does: mint a stream token, POST the command to its uri, read the SSE stream.
const [nStr, base, id, key] = process.argv.slice(2);
let ok = 0;
for (let i = 0; i < Number(nStr); i++) {
  const m = await fetch(`${base}/v1/sandboxes/${id}/runs/stream/token`, {
    method: "POST", headers: { Authorization: `Bearer ${key}`, "Content-Type": "application/json" },
    body: JSON.stringify({ command: "true" }),
  });
  const tok = await m.json();
  const r = await fetch(tok.uri, {
    method: "POST", body: JSON.stringify({ command: "true" }),
    headers: { Authorization: `Bearer ${tok.token}`, Accept: "text/event-stream", "Content-Type": "application/json" },
  });
  if ((await r.text()).includes("event: exit")) ok++;
}
console.log(`${ok} ok of ${nStr}`);
if (ok !== Number(nStr)) process.exit(1);
