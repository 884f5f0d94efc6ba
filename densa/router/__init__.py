"""The router: one OpenAI endpoint in front of several densa workers (torch-free; docs/routing.md).

config    RouterConfig: pools, policy, weights, timeouts (validated once, frozen)
cli       `densa router` flags and process
app       the FastAPI app: proxied OpenAI routes, /health, /metrics, its lifespan
tokens    the workers' tokenizer with a cache of text pieces (prompts re-send their history)
incoming  what a request says to the router: prompt tokens, tenant scope, session, max_tokens
routing   Router: request -> worker (or prefill + decode pair) and the bookkeeping around it
policy    the weighted five-signal score, and the single-signal baselines (a registry)
prefix    block hashes (the workers' chain) and each worker's approximate prefix index
ring      consistent hashing with virtual nodes (new sessions' homes)
sessions  x-session-affinity -> worker, with a TTL
lengths   expected output length per route, learned from finished requests
workers   worker state, load polling, ejection with exponential backoff, re-admission
membership  the worker set replaced while serving (PUT /densa/workers; densa cluster)
proxy     forwarding with retries before the first byte, streams relayed chunk by chunk
metrics   GET /metrics (Prometheus)
"""
