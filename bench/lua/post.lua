-- wrk script for bench/peers.py: POST the body held in the file named by $PEERS_BODY
-- (JSON) to the URL given to wrk, and print one JSON line at the end:
--   PEERS {"requests":..,"duration_us":..,"errors":{..},"p50_us":..,"p99_us":..,..}
-- A non-2xx/3xx answer counts in errors.status (wrk's own accounting).

local f = assert(io.open(os.getenv("PEERS_BODY"), "rb"))
local body = f:read("*a")
f:close()

wrk.method = "POST"
wrk.body = body
wrk.headers["Content-Type"] = "application/json"

function done(summary, latency, requests)
   local e = summary.errors
   io.write(string.format(
      'PEERS {"requests":%d,"duration_us":%d,"bytes":%d,' ..
      '"errors":{"connect":%d,"read":%d,"write":%d,"status":%d,"timeout":%d},' ..
      '"p50_us":%d,"p90_us":%d,"p99_us":%d,"mean_us":%.1f,"max_us":%d}\n',
      summary.requests, summary.duration, summary.bytes,
      e.connect, e.read, e.write, e.status, e.timeout,
      latency:percentile(50), latency:percentile(90), latency:percentile(99),
      latency.mean, latency.max))
end
