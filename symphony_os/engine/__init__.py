"""The engine (level 2): batches every producer's `pred`s into forward passes over the paged KV
pool. `loop.py` ties together `scheduler.py` (what runs next, as plain data), `model_runner.py`
(that data as tensors through the model; `cuda_graph.py` on CUDA) and `sampling.py` (what each
`pred` asked for), answering each request's `pred_future.PredFuture`."""
from .loop import Engine

__all__ = ["Engine"]
