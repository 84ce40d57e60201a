-- wrk script: small non-streaming completions, max_tokens cycling 1..4.
-- wrk -t1 -c64 -d10s -s crates/switchyard-gateway/benches/wrk/completions.lua http://127.0.0.1:8000
wrk.method = "POST"
wrk.headers["content-type"] = "application/json"
local n = 0
request = function()
  n = n + 1
  local body = string.format(
    '{"model":"sim-8b","prompt":"Write one sentence about the sea.","max_tokens":%d}', 1 + n % 4)
  return wrk.format(nil, "/v1/completions", nil, body)
end
