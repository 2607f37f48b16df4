"""Symphony's Triton kernels (imported as `symphony_os.kernels`). Over the paged KV pool:
`paged_attention` (decode and prefill attention), `kv_store` (slot writes, page copies) and
`sampling` (batched logits processing and seeded sampling). Inside the decoder layer:
`norm_rope` (RMSNorm, with the residual add before it, and the rotary embedding) and
`activation` (the SiLU gate). Each module imports triton; this package does not, so importing
it costs nothing on machines without a GPU."""
