"""Symphony: serve LLM inference programs (WebAssembly LIPs), not prompts.

The package is laid out in layers, each a folder that imports only the ones below it
(tests/test_layers.py checks the rule):

    errors.py   the one table of error codes, shared by the host and every SDK
    kernels/    Triton kernels (attention over the paged pool, norms, RoPE, sampling)
    wasm/       WebAssembly: fibers and their C half, guest memory, program loading and checking
    kv/         the paged KV pool and KVFS, the file system over it
    model/      the decoder, its loading and its attention backends
    engine/     the batch scheduler, the runner, sampling and the loop (level 2)
    lip/        LIP processes: the system calls, the runtime's workers (level 1), limits
    server/     `symphony serve`: HTTP/WebSocket API, tenants, the OpenAI endpoint
    client/     Python clients of the server and their commands
    cli.py      the `symphony` command
"""
