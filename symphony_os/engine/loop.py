"""The engine loop: takes `pred` requests from any thread, asks the batch scheduler for a plan,
reserves KV slots through KVFS, runs the model once per batch, and completes each request with
what it asked for. A batch is `launch`ed and `complete`d apart (`step` does both), so that a
caller can work while an asynchronous device runs it; the steps it may run before anyone asks
are in `speculation.py`. It owns no policy of its own: scheduling is in `scheduler.py`, memory
in `kvfs.py`/`pool.py`, the model in `model_runner.py`."""
from __future__ import annotations

import threading
import time
from bisect import bisect_left as _bucket_of
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import torch

from ..errors import InvalidArgument, PoolExhausted, Unsupported
from ..kv.kvfs import KVFS, KvSession
from ..kv.pool import KVPool
from ..model.attention import select_backend
from ..model.loader import LoadedModel, load_model
from .gc_tuning import tune_gc, untune_gc
from .grammar import Grammar, GrammarCompiler
from .model_runner import ModelRunner, SequenceInput
from .pred_future import PredFuture
from .sampling import GREEDY, GreedyEach, PredResult, Sample, ScoreEach, Want, process_logits, validate_want
from .scheduler import BatchPlan, BatchScheduler, PredRequest
from .speculation import ADOPTED, DROPPED, QUEUED, RUNNING, Speculation

# The bounds of the pred queue-wait histogram (EngineStats.queue_wait_counts), in seconds.
QUEUE_WAIT_BUCKETS_S = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
DEFAULT_CPU_KV_BYTES = 512 * 2**20
GPU_KV_FRACTION = 0.8  # of the device memory free after the weights


@dataclass(frozen=True)
class EngineStats:
    """Counters since the engine started. Times in seconds."""

    batches: int
    requests: int
    sequences: int
    tokens: int
    queue_wait_s: float
    forward_s: float
    # Preds by their wait for a batch: [i] waited at most QUEUE_WAIT_BUCKETS_S[i] (and more than
    # the bound before); the last, longer than every bound.
    queue_wait_counts: tuple[int, ...] = ()

    @property
    def mean_batch_size(self) -> float:
        return self.sequences / self.batches if self.batches else 0.0

    @property
    def tokens_per_batch(self) -> float:
        return self.tokens / self.batches if self.batches else 0.0

    @property
    def mean_queue_wait_ms(self) -> float:
        return 1000 * self.queue_wait_s / self.requests if self.requests else 0.0


def default_num_pages(loaded: LoadedModel, page_size: int, memory_utilization: float | None = None) -> int:
    """The KV pool's pages by memory: on the CPU DEFAULT_CPU_KV_BYTES; on CUDA GPU_KV_FRACTION of
    the device memory free after the weights, or, with `memory_utilization` (vLLM's
    --gpu-memory-utilization), what is left of that fraction of the device's whole memory once
    the weights and everything else on it are counted."""
    cfg, device = loaded.config, loaded.model.device
    element = torch.empty((), dtype=loaded.model.dtype).element_size()
    bytes_per_page = 2 * cfg.num_layers * page_size * cfg.num_kv_heads * cfg.head_dim * element
    budget = DEFAULT_CPU_KV_BYTES
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        budget = int(free * GPU_KV_FRACTION)
        if memory_utilization is not None:
            budget = int(total * memory_utilization) - (total - free)
            if budget < bytes_per_page:
                raise ValueError(f"a memory utilization of {memory_utilization:g} leaves no room for the KV cache: "
                                 f"{(total - free) / 2**30:.1f} of the device's {total / 2**30:.1f} GiB are in use "
                                 f"already (weights included)")
    elif memory_utilization is not None:
        raise ValueError("a memory utilization sizes the KV pool on a CUDA device; on the CPU give its pages "
                         "(--kv-pages)")
    return max(1, budget // bytes_per_page)


def _all_ints(values: list) -> bool:
    """Are all of `values` ints (bools included, as isinstance counts them)? Without a Python
    loop: a prompt's thousands of ids are checked on every pred."""
    return set(map(type, values)) <= _INT_TYPES


_INT_TYPES = {int, bool}
# The positions of a request `drop_queued` took out of the queue, which a batch planned before
# may still hold: `_prepare` skips it (no field of its own: that would cost every request).
DROPPED_REQUEST: list[int] = []


def _no_tokenizer(*_args, **_kwargs):
    raise InvalidArgument("this model was loaded without a tokenizer: pass token ids")


def direct_decode(tokenizer):
    """`tokenizer.decode`, or the Rust tokenizer's own decode where transformers' adds nothing
    (a fast tokenizer without clean-up of spaces): the same text for 2-3 us less Python per
    call, which LIPs streaming text pay on every token (measured: 7.4 against 9.5 us for 12
    tokens, and the wrapper's objects are cold after each forward pass)."""
    if tokenizer is None:  # a model built in memory (bench/gpu.py's random weights)
        return _no_tokenizer
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None or getattr(tokenizer, "clean_up_tokenization_spaces", True):
        return tokenizer.decode
    return backend.decode


class LaunchedBatch:
    """A batch between `Engine.launch` and `Engine.complete`: its chunks and sequences, and its
    forward pass under way (`logits.result()` waits for it)."""

    __slots__ = ("protect", "runnable", "seqs", "wants", "masks", "logits", "started", "error", "tentative")

    def __init__(self, protect, runnable: list, seqs: list):
        self.protect, self.runnable, self.seqs = protect, runnable, seqs
        self.wants = self.masks = self.logits = self.error = None
        self.started = 0.0
        self.tentative = False  # it runs tentative steps (speculation.py)


class _Ran:
    """The logits of a runner without `launch`, computed already."""

    __slots__ = ("logits",)

    def __init__(self, logits):
        self.logits = logits

    def result(self):
        return self.logits


class Engine:
    """Model + KV pool + KVFS + batch scheduler, driven by `step()` or a background thread."""

    def __init__(self, loaded: LoadedModel, page_size: int = 16, num_pages: int | None = None,
                 token_budget: int = 512, max_batch_size: int = 256, attention: str | None = None,
                 max_model_len: int | None = None, seed: int = 0, memory_utilization: float | None = None):
        """`max_model_len`: the most tokens a KV file may hold (default: the model's context,
        `max_position_embeddings`; more is allowed here, the command line refuses it as vLLM does). `seed`: of the draws of unseeded samples.
        `memory_utilization`: sizes the KV pool on CUDA when `num_pages` is not given
        (`default_num_pages`)."""
        self.loaded = loaded
        cfg = loaded.config
        if max_model_len is not None and max_model_len <= 0:
            raise ValueError(f"max_model_len must be positive, got {max_model_len}")
        if memory_utilization is not None and not 0 < memory_utilization <= 1:
            raise ValueError(f"the memory utilization is a fraction in (0, 1], got {memory_utilization}")
        self.max_model_len = max_model_len or cfg.max_position_embeddings
        self.pool = KVPool(
            cfg.num_layers, cfg.num_kv_heads, cfg.head_dim,
            num_pages or default_num_pages(loaded, page_size, memory_utilization), page_size,
            loaded.model.dtype, loaded.model.device,
        )
        self.kvfs = KVFS(self.pool, max_file_tokens=self.max_model_len)
        self.scheduler = BatchScheduler(token_budget, max_batch_size)
        self.backend = select_backend(loaded.model.device, attention, page_size, loaded.model.dtype)
        self.runner = ModelRunner(loaded.model, self.pool, self.backend)
        self._generator = torch.Generator().manual_seed(seed)
        self._decode = direct_decode(loaded.tokenizer)
        self._queue_mutex = threading.Lock()  # taken directly: a Condition's own `with` is Python code
        self._queue_lock = threading.Condition(self._queue_mutex)
        self._step_lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._stopping = False
        self._threads: dict[str, ThreadPoolExecutor] = {}  # _helper_thread's (the tokenizer's, the grammar masks')
        self._grammars: GrammarCompiler | None = None  # grammar()'s, made on first use
        self._speculating = False  # speculate() was called: batches may hold tentative steps
        self._tentative_prepared = False  # the batch being prepared holds one (launch)
        self._async_of: tuple = (None, False)  # runs_async's answer, for the runner it was asked for
        self._counters = dict(batches=0, requests=0, sequences=0, tokens=0, queue_wait_s=0.0, forward_s=0.0)
        self._queue_wait_counts = [0] * (len(QUEUE_WAIT_BUCKETS_S) + 1)

    @classmethod
    def from_path(cls, path, device: str | None = None, dtype: str | None = None, **kwargs) -> "Engine":
        return cls(load_model(path, dtype=dtype, device=device), **kwargs)

    # ---- the Python API ----

    def session(self, tenant: str = "default") -> KvSession:
        return self.kvfs.session(tenant)

    def tokenize(self, text: str, add_special_tokens: bool = True) -> list[int]:
        if self.loaded.tokenizer is None:
            _no_tokenizer()
        return self.loaded.tokenizer.encode(text, add_special_tokens=add_special_tokens)

    def detokenize(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._decode(ids, skip_special_tokens=skip_special_tokens)

    def chat_template(self, messages: list[dict], add_generation_prompt: bool = True,
                      default_template: str | None = None, tools: list[dict] | None = None) -> str:
        """The messages rendered with the model's own chat template (transformers' sandboxed
        Jinja), or `default_template` for a model without one, with `tools` (OpenAI's function
        definitions) for a template that shows them; Unsupported when there is neither,
        InvalidArgument when the template refuses them (roles out of order, say)."""
        tokenizer = self.loaded.tokenizer
        template = self.chat_template_source(default_template)
        try:
            return tokenizer.apply_chat_template(messages, chat_template=template, tools=tools or None,
                                                 add_generation_prompt=add_generation_prompt, tokenize=False)
        except Exception as error:  # the template's own complaints (raise_exception), or a broken template
            raise InvalidArgument(f"the chat template refused the messages: {error}") from None

    def chat_template_source(self, default_template: str | None = None) -> str:
        """The model's chat template (Jinja source), else `default_template`; Unsupported when
        there is neither."""
        tokenizer = self.loaded.tokenizer
        template = getattr(tokenizer, "chat_template", None) or default_template
        if tokenizer is None or not template:
            raise Unsupported("the model has no chat template")
        return template

    def grammar(self, kind: int, source: str) -> Grammar:
        """A grammar for constrained decoding (grammar.py: kind 0 a JSON schema, 1 a regex, 2 a
        Lark grammar); InvalidArgument when `source` is not one."""
        if self._grammars is None:
            self._grammars = GrammarCompiler(self.loaded.tokenizer, self.loaded.config.vocab_size)
        return self._grammars.compile(kind, source)

    def tokenize_later(self, text: str, add_special_tokens: bool = True) -> PredFuture:
        """`tokenize` on the engine's tokenizer thread: a future of (token ids, the thread's CPU
        seconds for them), answered in the order asked. For long texts (a MiB takes 0.5-1.7 s
        here), whose caller must not hold its own thread that long; the tokenizer releases the
        GIL while it works."""
        future = PredFuture()

        def work() -> None:
            started = time.thread_time()
            try:
                ids = self.tokenize(text, add_special_tokens)
            except BaseException as error:  # the caller's to see (no tokenizer, say)
                future.set_exception(error)
                return
            future.set_result((ids, time.thread_time() - started))

        self._helper_thread("tokenize").submit(work)
        return future

    def submit(self, session: KvSession, handle: int, tokens: list[int], positions: list[int] | None = None,
               want: Want = GREEDY) -> PredFuture:
        """Queue a pred: append `tokens` to the file behind `handle` (at `positions`; None
        continues the file) and answer `want`. Returns a PredFuture of PredResult (or the error)."""
        return self.submit_request(session, handle, tokens, positions, want).future

    def submit_request(self, session: KvSession, handle: int, tokens: list[int], positions: list[int] | None = None,
                       want: Want = GREEDY) -> PredRequest:
        """submit(), returning the queued request itself (its file, the tokens it has yet to
        append) as well as its future: for callers that account for what is in flight."""
        vocab = self.loaded.config.vocab_size
        tokens = list(tokens)
        if not tokens:
            raise InvalidArgument("pred needs at least one token")
        if len(tokens) == 1:  # a decode step: no generator to set up
            if not isinstance(tokens[0], int) or not 0 <= tokens[0] < vocab:
                raise InvalidArgument(f"token ids must be integers in [0, {vocab})")
        elif not (_all_ints(tokens) and min(tokens) >= 0 and max(tokens) < vocab):
            raise InvalidArgument(f"token ids must be integers in [0, {vocab})")
        if positions is not None:
            positions = list(positions)
            if len(positions) != len(tokens):
                raise InvalidArgument(f"{len(tokens)} tokens but {len(positions)} positions")
            if len(positions) == 1:  # a decode step: the check without a generator
                valid = isinstance(positions[0], int) and -2**31 <= positions[0] < 2**31
            else:
                valid = _all_ints(positions) and min(positions) >= -2**31 and max(positions) < 2**31
            if not valid:
                raise InvalidArgument("positions must be 32-bit integers, as the guest ABI passes them")
        validate_want(want, vocab)
        if want.__class__ is ScoreEach and len(tokens) < 2:
            raise InvalidArgument("score-each scores the tokens after the first: give at least 2")
        request = PredRequest(session.take_for_pred(handle), tokens, positions, want)
        with self._queue_mutex:
            self.scheduler.add(request)
            if self._thread is not None:  # only the background loop waits on the queue
                self._queue_lock.notify()
        return request

    def submit_decode(self, session: KvSession, handle: int, token: int, answer=None) -> PredRequest:
        """Queue one greedy decode step continuing the file behind `handle`, answered through
        `answer.settle(result, error)` (any object with that method; None: a PredFuture): for a
        caller that checked `token` already (an integer in [0, vocab_size)), such as a LIP's
        fast `pred` (lip/process.py). The handle is checked here, as `submit` checks it."""
        request = PredRequest(session.take_for_pred(handle), [token], None, GREEDY, answer)
        with self._queue_mutex:
            self.scheduler.add(request)
            if self._thread is not None:
                self._queue_lock.notify()
        return request

    # ---- tentative steps (speculation.py) ----

    @property
    def runs_async(self) -> bool:
        """Does a batch's forward pass run while the host goes on (a runner with `launch`, or a
        CUDA device, whose kernels are queued)? Only then do tentative steps pay: on a host that
        computes the pass itself, nothing can overlap it."""
        runner = self.runner
        if runner is not self._async_of[0]:
            self._async_of = (runner, getattr(runner, "launch", None) is not None
                              or self.loaded.model.device.type == "cuda")
        return self._async_of[1]

    def speculate(self, file, token: int) -> Speculation | None:
        """Queue the greedy step `token` continuing `file` before anyone asked for it
        (speculation.py); None when it could not run tentatively (the next token needs a page
        of its own)."""
        kvfs = self.kvfs
        with kvfs.lock:
            if file.length % self.pool.page_size == 0 or file.host_pages or not file.pages:
                return None
            kvfs.acquire(file)  # the file outlives the step: `_end_speculations` releases it
        speculation = Speculation()
        request = speculation.request = PredRequest(file, [token], None, GREEDY, speculation)
        request.tentative = True
        self._speculating = True
        with self._queue_mutex:
            self.scheduler.add(request)
            if self._thread is not None:
                self._queue_lock.notify()
        return speculation

    def adopt(self, speculation: Speculation, answer) -> bool:
        """Make a tentative step the caller's own pred, answered through `answer.settle(result,
        error)`: True if it could be (not dropped, the file as it was); else it is dropped and the
        caller submits the step itself."""
        kvfs = self.kvfs
        with kvfs.lock:
            request, state = speculation.request, speculation.state
            if state == RUNNING:  # in a batch now: its token becomes the file's
                if not kvfs.adopt_tentative(request.file, request.positions[0], request.length_before,
                                            speculation.page, kvfs.clock()):
                    speculation.state = DROPPED
                    kvfs.release(request.file)
                    return False
            elif state != QUEUED:
                return False
            request.file.inflight += 1  # (take_for_pred's count; the reference was taken already)
            request.tentative = False
            speculation.answer = answer
            speculation.state = ADOPTED
            return True

    def abandon(self, speculation: Speculation) -> None:
        """Drop a tentative step nobody will adopt: its file released at once (a guest may close
        or remove it next), its pass's work, if it is in one, discarded once it ran (its page
        stays pinned until then)."""
        kvfs = self.kvfs
        with kvfs.lock:
            state = speculation.state
            if state == ADOPTED or state == DROPPED:
                return
            speculation.state = DROPPED
            if state == QUEUED:
                with self._queue_mutex:
                    self.scheduler.discard(speculation.request)
            kvfs.release(speculation.request.file)

    def drop_queued(self, session: KvSession) -> int:
        """Take the preds on `session`'s files that no batch has started out of the queue, their
        files released and their answers going to no one: for a process that ends (a kill, an
        exit with a pred never waited for). A pred a batch started ends with its batch. How many
        were dropped."""
        files = session.files_in_flight()
        if not files:
            return 0
        kvfs = self.kvfs
        dropped = []
        with kvfs.lock:  # `_prepare` starts requests under it: one not started now never will be
            with self._queue_mutex:
                for request in list(self.scheduler.waiting.values()):
                    if request.file in files and request.started_at is None and not request.tentative:
                        self.scheduler.discard(request)
                        request.positions = DROPPED_REQUEST  # a batch that planned it already skips it
                        dropped.append(request)
            kvfs.end_preds([(request.file, True, None) for request in dropped], kvfs.clock())
        return len(dropped)

    def pred(self, session: KvSession, handle: int, tokens: list[int], positions: list[int] | None = None,
             want: Want = GREEDY) -> PredResult:
        """submit() and wait; without a background thread, runs batches in this thread."""
        future = self.submit(session, handle, tokens, positions, want)
        if self._thread is None:
            while not future.done():
                self.step()
        return future.result()

    def stats(self) -> EngineStats:
        return EngineStats(**self._counters, queue_wait_counts=tuple(self._queue_wait_counts))

    # ---- the loop ----

    def step(self) -> bool:
        """Run one batch; False when nothing was waiting."""
        launched = self.launch()
        if launched is None:
            return False
        self.complete(launched)
        return True

    def launch(self) -> "LaunchedBatch | None":
        """The first half of `step`: plan the next batch, reserve its slots and start its forward
        pass (on a device that runs asynchronously, the host is free until `complete`); None when
        nothing was waiting. Every launched batch must be completed, one at a time."""
        self._step_lock.acquire()
        try:
            with self._queue_mutex:
                plan = self.scheduler.schedule()
            if plan is None:
                self._step_lock.release()
                return None
            protect = self.kvfs.protect([chunk.request.file for chunk in plan.chunks])
            protect.__enter__()
            try:
                self._tentative_prepared = False
                runnable, seqs = self._prepare(plan)
                launched = LaunchedBatch(protect, runnable, seqs)
                launched.tentative = self._tentative_prepared
                if runnable:
                    self._start_run(launched)
            except BaseException:
                protect.__exit__(None, None, None)
                raise
            return launched
        except BaseException:
            self._step_lock.release()
            raise

    def complete(self, launched: "LaunchedBatch") -> None:
        """The second half of `step`: wait for the batch's forward pass, sample, answer."""
        try:
            if launched.runnable:
                self._finish_run(launched)
        finally:
            try:
                launched.protect.__exit__(None, None, None)
            finally:
                self._step_lock.release()

    def _prepare(self, plan: BatchPlan):
        """Reserve KV slots for each chunk; a chunk that cannot run fails its request (or, when
        only memory is short and others run, waits for the next batch)."""
        runnable, seqs, failed, short = [], [], [], []
        now = time.perf_counter()
        kvfs = self.kvfs
        with kvfs.lock:  # once per batch, not per chunk
            clock = kvfs.clock()  # the files' last use: once per batch
            for chunk in plan.chunks:
                request, file = chunk.request, chunk.request.file
                try:
                    if request.length_before is None and request.positions is None and len(request.tokens) == 1:
                        if request.tentative:  # a step nobody asked for yet (speculation.py)
                            self._prepare_tentative(request, now, runnable, seqs, chunk)
                            continue
                        # A decode step continuing its file (most chunks): one KVFS call.
                        request.length_before = file.length
                        request.started_at = now
                        position, slot = kvfs.reserve_next(file, clock)
                        request.positions = positions = [position]
                        runnable.append(chunk)
                        seqs.append(SequenceInput(request.tokens, positions, [slot], file.pages, file.length,
                                                  request.want.__class__ is not GreedyEach,
                                                  request.want.__class__ is GreedyEach))
                        continue
                    if request.positions is DROPPED_REQUEST:  # since it was planned (drop_queued)
                        continue
                    from_file = False  # positions taken from the file just now: reserve_slots checks none
                    if request.length_before is None:
                        request.length_before = file.length
                        request.started_at = now
                        if request.positions is None:
                            start = file.next_position
                            n = len(request.tokens)
                            request.positions = [start] if n == 1 else list(range(start, start + n))
                            from_file = start >= 0  # (a file merged at negative positions is checked)
                    whole = chunk.count == len(request.tokens)  # no slices to make
                    positions = request.positions if whole else request.positions[chunk.start:chunk.start + chunk.count]
                    slots = kvfs.reserve_slots(file, positions, clock, from_file)
                except PoolExhausted as error:
                    short.append((request, None, error))
                    continue  # others in this batch hold the memory: try again next batch
                except Exception as error:  # a request that cannot run fails alone, never the engine's loop
                    failed.append((request, None, error))
                    continue
                runnable.append(chunk)
                each = isinstance(request.want, GreedyEach)
                scoring = request.want.__class__ is ScoreEach
                seqs.append(SequenceInput(
                    tokens=request.tokens if whole else request.tokens[chunk.start:chunk.start + chunk.count],
                    positions=positions,
                    # The file's own page list, not a copy: no one else changes the pages of a
                    # file with a pred in flight (truncate refuses it, eviction and swapping skip
                    # it while protected), and the batch's one chunk per file appended already.
                    slots=slots, page_table=file.pages, context_len=file.length,  # resident: reserved just now
                    wants_logits=chunk.is_last and not each and not scoring, greedy_each=each,
                    # (each row against the token after it, the next chunk's first for its last)
                    score_k=request.want.k if scoring else -1,
                    score_next=request.tokens[chunk.start + 1:chunk.start + chunk.count + 1] if scoring else None,
                ))
        if short and not runnable:  # none runs, so nothing frees pages for a next try: they fail
            failed += short
        if failed:
            self._finish_all(failed)
        return runnable, seqs

    def _prepare_tentative(self, request: PredRequest, now: float, runnable: list, seqs: list, chunk) -> None:
        """_prepare of a tentative step (under the KVFS lock): its slot reserved without the file
        growing (KVFS.reserve_tentative), or, when that cannot be, the step dropped."""
        speculation, file = request.future, request.file
        if speculation.state != QUEUED:  # dropped since it was planned (and out of the queue)
            return
        reserved = self.kvfs.reserve_tentative(file)
        if reserved is None:
            speculation.state = DROPPED
            with self._queue_mutex:
                self.scheduler.discard(request)
            self.kvfs.release(file)
            return
        position, slot, speculation.page = reserved
        speculation.state = RUNNING
        self._tentative_prepared = True
        request.length_before = file.length
        request.started_at = now
        request.positions = [position]
        runnable.append(chunk)
        seqs.append(SequenceInput(request.tokens, request.positions, [slot], file.pages, file.length + 1, True, False))

    def _start_run(self, launched: "LaunchedBatch") -> None:
        """The forward pass of a prepared batch, started (the runner's `launch`, or its `run`)."""
        launched.started = time.perf_counter()
        try:
            # A row of logits per chunk that wants them (GreedyEach chunks get argmax_each instead).
            wants = launched.wants = [chunk.request.want for chunk, seq in zip(launched.runnable, launched.seqs)
                                      if seq.wants_logits]
            launched.masks = self._grammar_masks(wants)  # computed while the forward runs
            launch = getattr(self.runner, "launch", None)
            launched.logits = launch(launched.seqs) if launch is not None else _Ran(self.runner.run(launched.seqs))
        except BaseException as error:  # failed at once (a Ctrl-C too): complete() fails the batch
            launched.error = error

    def _finish_run(self, launched: "LaunchedBatch") -> None:
        chunks, seqs, started = launched.runnable, launched.seqs, launched.started
        if launched.error is not None and not isinstance(launched.error, Exception):
            for chunk in chunks:  # its requests failed (their tokens undone), then the interrupt goes on
                self._finish(chunk.request, error=launched.error)
            raise launched.error
        try:
            if launched.error is not None:
                raise launched.error
            wants, masks = launched.wants, launched.masks
            logits = launched.logits.result()
            for chunk, seq in zip(chunks, seqs):
                if seq.greedy_each:
                    request = chunk.request
                    request.each = (request.each or []) + seq.argmax_each
                elif seq.score_k >= 0:
                    request = chunk.request
                    request.each = (request.each or []) + seq.scores
            results = process_logits(logits, wants, self._generator,
                                     masks.result() if masks is not None else None) if wants else []
        except Exception as error:  # a failed forward fails its batch, not the engine
            for chunk in chunks:
                self._finish(chunk.request, error=error)
            return
        c = self._counters
        c["batches"] += 1
        c["sequences"] += len(chunks)
        c["tokens"] += sum(len(s.tokens) for s in seqs)
        if launched.tentative:  # the tentative steps nobody adopted are no one's tokens
            dropped = sum(1 for chunk in chunks if chunk.request.tentative)
            c["sequences"] -= dropped
            c["tokens"] -= dropped
        c["forward_s"] += time.perf_counter() - started
        done = iter(results)
        finished = []
        for chunk in chunks:
            chunk.request.done += chunk.count
            if chunk.is_last:
                request = chunk.request
                want = request.want
                if want.__class__ is ScoreEach:
                    scores = request.each or []
                    result = PredResult(scores=[s[0] for s in scores], score_top_ids=[s[1] for s in scores],
                                        score_top_logprobs=[s[2] for s in scores])
                else:
                    result = PredResult(tokens=request.each or []) if isinstance(want, GreedyEach) else next(done)
                error = result.error  # its row alone failed (process_logits_reference)
                finished.append((request, result if error is None else None, error))
        self._finish_all(finished, launched.tentative)

    def _helper_thread(self, name: str) -> ThreadPoolExecutor:
        """A worker thread of the engine's own ("symphony-NAME"), made on first use (from any thread)."""
        thread = self._threads.get(name)
        if thread is None:
            with self._queue_mutex:
                thread = self._threads.get(name)
                if thread is None:
                    thread = self._threads[name] = ThreadPoolExecutor(1, thread_name_prefix=f"symphony-{name}")
        return thread

    def _grammar_masks(self, wants: list[Want]):
        """A future of {row: its grammar's allowed-token bitmask, or the grammar's error} for the
        rows sampled under a grammar, computed on a thread of its own while the forward pass
        runs (llguidance releases the GIL); None when no row has a grammar. The grammars are
        the engine's while their preds are in flight (syscalls.py refuses their owners)."""
        if self._grammars is None:  # no grammar made here yet: no scan a batch (one made elsewhere
            return None             # would still be applied: sampling computes a mask it is not given)
        rows = [(row, want.grammar) for row, want in enumerate(wants)
                if want.__class__ is Sample and want.grammar is not None]
        if not rows:
            return None

        def compute() -> dict[int, torch.Tensor | Exception]:
            masks: dict[int, torch.Tensor | Exception] = {}
            for row, grammar in rows:
                try:
                    masks[row] = grammar.next_bitmask()
                except Exception as error:  # this row fails alone (process_logits)
                    masks[row] = error
            return masks

        return self._helper_thread("grammar").submit(compute)

    def _finish(self, request: PredRequest, result: PredResult | None = None,
                error: BaseException | None = None) -> None:
        self._finish_all([(request, result, error)])

    def _finish_all(self, outcomes: list[tuple[PredRequest, PredResult | None, BaseException | None]],
                    tentative: bool = True) -> None:
        """Take the requests out of the queue, release their files, complete their futures.
        `tentative`: whether any of them may have run tentatively (a batch knows)."""
        with self._queue_mutex:
            self.scheduler.remove_all([request for request, _, _ in outcomes])
        if tentative and self._speculating:
            outcomes = self._end_speculations(outcomes)
        kvfs = self.kvfs
        started, waited, counts = 0, 0.0, self._queue_wait_counts
        for request, _, _ in outcomes:
            if request.started_at is not None:
                started += 1
                wait = request.started_at - request.submitted_at
                waited += wait
                counts[_bucket_of(QUEUE_WAIT_BUCKETS_S, wait)] += 1
        with kvfs.lock:
            # A failed pred leaves its file as it was: the chunks it appended are undone.
            kvfs.end_preds([(request.file, error is not None, request.length_before) for request, _, error in outcomes],
                           kvfs.clock())
        counters = self._counters  # counted before the futures are answered: a waiter may read them
        counters["requests"] += started
        counters["queue_wait_s"] += waited
        for request, result, error in outcomes:
            request.future.settle(result, error)

    def _end_speculations(self, outcomes: list) -> list:
        """The tentative steps among a batch's outcomes, ended: each one's page unpinned; one
        still tentative (nobody adopted it) discarded, its file released. The other outcomes
        are returned, an adopted step's among them (its answer goes to its adopter)."""
        kept = []
        kvfs = self.kvfs
        with kvfs.lock:
            for outcome in outcomes:
                request = outcome[0]
                speculation = request.future
                if speculation.__class__ is Speculation:
                    if speculation.page >= 0:
                        self.pool.unpin(speculation.page)
                        speculation.page = -1
                    if request.tentative:  # nobody adopted it
                        if speculation.state != DROPPED:  # (dropped: its file was released then)
                            speculation.state = DROPPED
                            kvfs.release(request.file)
                        continue
                kept.append(outcome)
        return kept

    def run_until_idle(self) -> None:
        while self.step():
            pass

    def start(self) -> None:
        """Run batches on a background thread until `stop()`; the GC is tuned for serving
        meanwhile (gc_tuning.py). A caller driving `step()` itself can use `serving_gc()`."""
        if self._thread is not None:
            return
        tune_gc()
        self._stopping = False
        self._thread = threading.Thread(target=self._loop, name="symphony-batch", daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while True:
            with self._queue_lock:
                while not self.scheduler and not self._stopping:
                    self._queue_lock.wait()
                if self._stopping:
                    return
            self.step()

    def stop(self) -> None:
        if self._thread is None:
            return
        with self._queue_lock:
            self._stopping = True
            self._queue_lock.notify_all()
        self._thread.join()
        self._thread = None
        untune_gc()
