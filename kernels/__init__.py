"""Triton kernels over the paged KV pool (imported as `symphony_os.kernels`):
`paged_attention` (decode and prefill attention), `kv_store` (slot writes, page copies) and
`sampling` (batched logits processing and seeded sampling). Each module imports triton; this
package does not, so importing it costs nothing on machines without a GPU."""
