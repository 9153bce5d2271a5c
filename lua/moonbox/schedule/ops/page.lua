--- moonbox.schedule.ops.page — the status page of `moonbox schedule --listen`: its HTML (made
-- here, on the server, every user-controlled string escaped), its stylesheet and its script.
--
-- The page works without its script; the script (vanilla, same-origin only, no inline code, so
-- the Content-Security-Policy can forbid everything else) refreshes the page's <main> every
-- 5 s and drives the pause/resume/trigger buttons, which exist only when a control token is
-- configured: they POST with the token in an X-Moonbox-Token header (never a cookie, so another
-- site cannot make the browser send it; a custom header also forces a CORS preflight that this
-- server never grants). Nothing is fetched from anywhere but this listener.
-- luacheck: no max line length
local clock_mod = require "moonbox.schedule.clock"
local duration = require "moonbox.duration"

local M = {}

M.CSP = "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self'; connect-src 'self'; " ..
  "base-uri 'none'; form-action 'none'; frame-ancestors 'none'"

--- page.esc(s) -> s with & < > " ' as HTML character references.
function M.esc(s)
  return (tostring(s):gsub("[&<>\"']", { ["&"] = "&amp;", ["<"] = "&lt;", [">"] = "&gt;", ['"'] = "&quot;",
    ["'"] = "&#39;" }))
end
local esc = M.esc

local function t(v) return v and clock_mod.format(v) or "-" end

local function took(r)
  if not (r.started_at and r.ended_at) then return "-" end
  local d = r.ended_at - r.started_at
  if d < 60 then return string.format("%.1fs", d) end
  return duration.format(math.floor(d + 0.5))
end

--- page.short_owner(owner) -> "HOST/PID" of an owner id "HOST/PID/START" (moonbox.ledger),
-- "?" for nil. Does not yield.
function M.short_owner(owner)
  if owner == nil then return "?" end
  return (tostring(owner):gsub("/[^/]*$", ""))
end

--- page.html(status) -> the page. status: {recipe, now, control, store_error, schedules = {{name,
-- spec, next_fire, paused, paused_reason, failures, strip = {rows}}}, runs = {rows with
-- sandboxes, held, trace (bool), resumes and resumed_by (a durable run resumed after its
-- daemon died: how many times, and the daemon that made the latest)}}.
function M.html(st)
  local o = {}
  local function w(...) for i = 1, select("#", ...) do o[#o + 1] = select(i, ...) end end
  w('<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8">',
    '<meta name="viewport" content="width=device-width, initial-scale=1">',
    '<title>moonbox schedule: ', esc(st.recipe), '</title>',
    '<link rel="stylesheet" href="/static/status.css"></head>\n<body>',
    '<header><h1>moonbox schedule</h1><p class="sub">', esc(st.recipe), ' &middot; pid ', esc(st.pid),
    ' &middot; <span id="updated">', esc(t(st.now)), '</span></p></header>\n')
  if st.control then
    w('<section id="control"><label>control token <input id="token" type="password" autocomplete="off">',
      '</label> <span id="result" role="status"></span></section>\n')
  end
  w('<main id="main">')
  if st.store_error then
    w('<p class="alert">the state store does not answer: ', esc(st.store_error), '</p>')
  end
  w('<h2>Schedules</h2><table id="schedules"><thead><tr><th>schedule</th><th>spec</th><th>next fire</th>',
    '<th>state</th><th>last runs (oldest to newest)</th>', st.control and '<th></th>' or '', '</tr></thead><tbody>')
  for _, s in ipairs(st.schedules) do
    w('<tr data-schedule="', esc(s.name), '"><td class="name">', esc(s.name), '</td><td>', esc(s.spec),
      '</td><td class="t">', s.paused and '- (paused)' or esc(t(s.next_fire)), '</td><td>')
    if s.paused then
      w('<span class="badge paused">paused</span> ', esc(s.paused_reason or ""))
    else
      w('<span class="badge active">active</span>')
    end
    if (s.failures or 0) > 0 then w(' <span class="fails">', esc(s.failures), ' consecutive failure(s)</span>') end
    w('</td><td class="strip">')
    for i = #s.strip, 1, -1 do
      local r = s.strip[i]
      w('<span class="cell ', esc(r.outcome), '" title="run ', esc(r.id), ' ', esc(r.outcome), ' slot ',
        esc(t(r.slot)), '"></span>')
    end
    w('</td>')
    if st.control then
      w('<td class="buttons">')
      if s.paused then
        w('<button type="button" data-action="resume" data-schedule="', esc(s.name), '">resume</button>')
      else
        w('<button type="button" data-action="pause" data-schedule="', esc(s.name), '">pause</button>')
      end
      w(' <button type="button" data-action="trigger" data-schedule="', esc(s.name), '">trigger</button></td>')
    end
    w('</tr>')
  end
  w('</tbody></table>\n<h2>Runs</h2><table id="runs"><thead><tr><th>id</th><th>schedule</th><th>slot</th>',
    '<th>trigger</th><th>started</th><th>took</th><th>outcome</th><th>sandboxes</th><th>error / reason</th>',
    '<th>trace</th></tr></thead><tbody>')
  for _, r in ipairs(st.runs) do
    w('<tr class="run ', esc(r.outcome), '" data-run="', esc(r.id), '"><td>', esc(r.id), '</td><td>',
      esc(r.schedule), '</td><td class="t">', esc(t(r.slot)), '</td><td>', esc(r.trigger), '</td><td class="t">',
      esc(t(r.started_at)),
      '</td><td>', esc(took(r)), '</td><td><span class="badge ', esc(r.outcome), '">', esc(r.outcome),
      '</span>')
    if (r.resumes or 0) > 0 then
      w(' <span class="resumed" title="resumed by ', esc(r.resumed_by or "?"), '">resumed ', esc(r.resumes),
        '&times; by ', esc(M.short_owner(r.resumed_by)), '</span>')
    end
    w('</td><td class="sandboxes">')
    local held = {}
    for _, h in ipairs(r.held or {}) do if h.sandbox_id then held[h.sandbox_id] = true end end
    for i, id in ipairs(r.sandboxes or {}) do
      w(i > 1 and ' ' or '', '<code', held[id] and ' class="held" title="still held"' or '', '>', esc(id), '</code>')
    end
    w('</td><td class="error">', esc(r.error or ""), '</td><td>')
    if r.trace then
      w('<a href="/runs/', esc(r.id), '/trace" download="moonbox-run-', esc(r.id), '.json">trace</a>')
    end
    w('</td></tr>')
  end
  w('</tbody></table>')
  if #st.runs == 0 then w('<p>no runs recorded yet</p>') end
  w('<p class="foot">Traces open in ui.perfetto.dev or chrome://tracing (Chrome trace event JSON).</p>')
  w('</main>\n<script src="/static/status.js"></script></body></html>\n')
  return table.concat(o)
end

M.CSS = [[
body { font: 14px/1.4 system-ui, sans-serif; margin: 1.5em; color: #1d1d1f; background: #fafafa; }
h1 { font-size: 1.4em; margin: 0; } h2 { font-size: 1.1em; margin-top: 1.5em; }
.sub { color: #666; margin: .2em 0 1em; }
table { border-collapse: collapse; width: 100%; background: #fff; }
th, td { text-align: left; padding: .3em .6em; border-bottom: 1px solid #e5e5e5; vertical-align: top; }
th { font-weight: 600; background: #f0f0f0; }
td.t { white-space: nowrap; }
td.error { color: #a00; white-space: pre-wrap; word-break: break-word; max-width: 40em; }
.strip .cell { display: inline-block; width: 10px; height: 18px; margin-right: 2px; border-radius: 2px; background: #ccc; }
.cell.ok { background: #2e9d4f; } .cell.failed, .cell.timeout { background: #d33; }
.cell.skipped { background: #bbb; } .cell.cancelled, .cell.interrupted { background: #e0a000; }
.cell.running, .cell.queued { background: #3b82f6; }
.badge { padding: 0 .4em; border-radius: 3px; background: #ddd; }
.badge.ok, .badge.active { background: #d6f5df; } .badge.failed, .badge.timeout { background: #fbd5d5; }
.badge.paused { background: #fde9b8; } .fails { color: #a00; }
.resumed { color: #555; font-size: .9em; }
code.held { background: #fde9b8; }
.alert { background: #fbd5d5; padding: .5em; }
#control { margin-bottom: 1em; } #result { margin-left: 1em; color: #555; }
.foot { color: #777; margin-top: 1em; }
]]

M.JS = [[
'use strict';
// moonbox schedule status page: refresh <main> every 5 s; control buttons POST with the token
// in a header (never a cookie). Only textContent is ever assigned: no markup from data.
(function () {
  var token = null;
  var input = document.getElementById('token');
  var result = document.getElementById('result');
  if (input) input.addEventListener('input', function () { token = input.value; });
  function say(text) { if (result) result.textContent = text; }
  function refresh() {
    return fetch('/', { cache: 'no-store', credentials: 'omit' }).then(function (r) {
      if (!r.ok) throw new Error('HTTP ' + r.status);
      return r.text();
    }).then(function (text) {
      var doc = new DOMParser().parseFromString(text, 'text/html');
      var fresh = doc.getElementById('main');
      var upd = doc.getElementById('updated');
      if (fresh) document.getElementById('main').replaceChildren.apply(document.getElementById('main'),
        Array.prototype.slice.call(fresh.childNodes));
      if (upd) document.getElementById('updated').textContent = upd.textContent;
    }).catch(function (e) { say('refresh failed: ' + e.message); });
  }
  document.addEventListener('click', function (ev) {
    var b = ev.target.closest ? ev.target.closest('button[data-action]') : null;
    if (!b) return;
    var action = b.getAttribute('data-action'), name = b.getAttribute('data-schedule');
    if (!token) { say('enter the control token first'); return; }
    b.disabled = true;
    fetch('/api/schedules/' + encodeURIComponent(name) + '/' + action, {
      method: 'POST', credentials: 'omit', headers: { 'X-Moonbox-Token': token }
    }).then(function (r) {
      return r.json().then(function (body) {
        say(r.ok ? (name + ': ' + body.message) : ('refused: ' + (body.message || r.status)));
      });
    }).catch(function (e) { say('failed: ' + e.message); }).then(refresh);
  });
  document.body.setAttribute('data-ready', '1');
  setInterval(refresh, 5000);
})();
]]

return M
