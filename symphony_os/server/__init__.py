"""`symphony serve`: the ASGI app (`app.py`) and its routes, a module per resource (`routes/`:
programs, processes, KV files, observability, the OpenAI-compatible endpoints); what every
request passes first (`guard.py`); shared state and request dependencies (`state.py`); tenants
and quotas (`tenants.py`); uploaded programs (`program_store.py`); served processes
(`process_table.py`); completions as processes of a built-in LIP (`completion.py`,
`builtin_lips.py`, `builtin/`); `/metrics` (`metrics.py`) and JSON logs (`logs.py`)."""
