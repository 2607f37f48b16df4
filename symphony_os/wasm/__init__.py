"""WebAssembly, knowing nothing of models or KV: guest calls as native wasmtime fibers
(`fiber.py` and its C half `fiber_native.c`, built by `native_build.py`), checked access to a
guest's memory (`guest_memory.py`), and programs: loaded, compiled under a time limit
(`compile_limit.py`, `compile_cache.py`) and checked against the WIT (`program.py`,
`component.py`, `wit.py`), and host functions for components (`component_linker.py`)."""
