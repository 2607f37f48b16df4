"""`symphony serve`: the ASGI app and its routes (`app.py`), what every request passes first
(`guard.py`), shared state and request dependencies (`state.py`), tenants and quotas
(`tenants.py`), uploaded programs (`program_store.py`), served processes (`process_table.py`),
the OpenAI-compatible endpoints (`openai_api.py`, `completion.py`, `builtin_lips.py` and
`builtin/`), `/metrics` (`metrics.py`) and JSON logs (`logs.py`)."""
