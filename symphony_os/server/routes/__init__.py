"""The server's HTTP and WebSocket routes, one module per resource: `programs.py` (uploads),
`processes.py` (launch, list, inspect, kill, stream), `kv.py` (the tenant's KV files),
`observability.py` (/health, /metrics) and `openai.py` (the OpenAI-compatible endpoints)."""
