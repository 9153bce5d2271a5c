// bench/client.mjs MODE N URL — Node's built-in fetch doing what curl_loop does (the official
// TypeScript SDK uses fetch underneath): `seq` awaits N GETs one after another, `conc` starts N
// at once and awaits them all.
const [mode, nStr, url] = process.argv.slice(2);
const n = Number(nStr);
let ok = 0;
let bytes = 0;
const headers = process.env.BENCH_AUTH ? { Authorization: process.env.BENCH_AUTH } : {};
async function one() {
  const r = await fetch(url, { headers });
  const body = await r.text();
  if (r.status === 200) ok++;
  bytes += body.length;
}
if (mode === "seq") {
  for (let i = 0; i < n; i++) await one();
} else {
  await Promise.all(Array.from({ length: n }, one));
}
console.log(`${ok} ok of ${n}, ${bytes} bytes`);
if (ok !== n) process.exit(1);
