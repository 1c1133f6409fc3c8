-- wrk script for benchmarks/http.py.
--
--   wrk ... -s benchmarks/wrk/bench.lua URL -- <mode> <key prefix>
--
-- mode "none":   no Idempotency-Key (the unprotected endpoint)
-- mode "unique": a new key on every request: <prefix>-<thread>-<n> (first executions)
-- mode "fixed":  the same key, <prefix>, on every request (replays)
--
-- Every request has the same JSON body. done() prints one line, "BENCH {json}",
-- with the counts and the latency percentiles in microseconds.

local threads = {}

function setup(thread)
   table.insert(threads, thread)
   thread:set("tid", #threads)
end

function init(args)
   mode = args[1] or "none"
   prefix = args[2] or "key"
   n = 0
   wrk.method = "POST"
   wrk.body = '{"amount": 1250, "currency": "EUR"}'
   wrk.headers["Content-Type"] = "application/json"
   if mode == "fixed" then
      wrk.headers["Idempotency-Key"] = prefix
   end
   fixed_request = wrk.format()
end

function request()
   if mode ~= "unique" then
      return fixed_request
   end
   n = n + 1
   return wrk.format(nil, nil, {
      ["Content-Type"] = "application/json",
      ["Idempotency-Key"] = prefix .. "-" .. tid .. "-" .. n,
   })
end

function done(summary, latency, requests)
   local e = summary.errors
   io.write(string.format(
      'BENCH {"requests": %d, "duration_us": %d, "connect_errors": %d, "read_errors": %d, ' ..
      '"write_errors": %d, "status_errors": %d, "timeouts": %d, "p50_us": %d, "p90_us": %d, ' ..
      '"p99_us": %d, "max_us": %d, "mean_us": %.1f}\n',
      summary.requests, summary.duration, e.connect, e.read, e.write, e.status, e.timeout,
      latency:percentile(50), latency:percentile(90), latency:percentile(99), latency.max,
      latency.mean))
end
