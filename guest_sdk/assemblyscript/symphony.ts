// symphony.ts: the AssemblyScript SDK for Symphony LLM Inference Programs (LIPs).
//
// A LIP is a WASI preview-1 command. Import this file and build with the compiler that
// `npm install` puts in guest_sdk/assemblyscript/node_modules:
//   asc prog.ts -O3 --runtime incremental --exportRuntime --exportStart _start \
//       --use abort=guest_sdk/assemblyscript/symphony/symphonyAbort -o prog.wasm
// Top-level statements of the program are its main; `args()` are its arguments.
//
// The system calls of wit/symphony.wit are declared raw below (`@external("symphony", ...)`).
// The wrappers turn their negative codes into `SymphonyError`-style aborts through `check`
// (AssemblyScript has no catchable exceptions): an error ends the process with its name on
// stderr. Callers that want to handle a code themselves use the raw calls and `ErrorCode`.
// A `Kv` is closed with `close()` (AssemblyScript runs no destructors); `Context` keeps a KV
// file and its tokens together (fill, generate until a stop, fork).

// ---- raw system calls (wit/symphony.wit) ----
@external("symphony", "vocab_size") export declare function vocab_size(): i32;
@external("symphony", "eos_ids") export declare function eos_ids(out_ptr: usize, cap: i32): i32;
@external("symphony", "bos_id") export declare function bos_id(): i32;
@external("symphony", "model_name") export declare function model_name(out_ptr: usize, cap: i32): i32;
@external("symphony", "tokenize") export declare function tokenize(text_ptr: usize, text_len: i32, flags: i32, out_ptr: usize, cap: i32): i32;
@external("symphony", "detokenize") export declare function detokenize(ids_ptr: usize, n: i32, out_ptr: usize, cap: i32): i32;
@external("symphony", "chat_template") export declare function chat_template(messages_ptr: usize, messages_len: i32, flags: i32, out_ptr: usize, cap: i32): i32;
@external("symphony", "kv_create") export declare function kv_create(): i32;
@external("symphony", "kv_open") export declare function kv_open(path_ptr: usize, path_len: i32, flags: i32): i32;
@external("symphony", "kv_fork") export declare function kv_fork(kv: i32): i32;
@external("symphony", "kv_extract") export declare function kv_extract(kv: i32, start: i32, end: i32): i32;
@external("symphony", "kv_merge") export declare function kv_merge(first: i32, second: i32): i32;
@external("symphony", "kv_len") export declare function kv_len(kv: i32): i32;
@external("symphony", "kv_truncate") export declare function kv_truncate(kv: i32, len: i32): i32;
@external("symphony", "kv_close") export declare function kv_close(kv: i32): i32;
@external("symphony", "kv_remove") export declare function kv_remove(path_ptr: usize, path_len: i32): i32;
@external("symphony", "kv_hint") export declare function kv_hint(kv: i32, flags: i32, keep_for_ms: i32, priority: i32): i32;
@external("symphony", "kv_open_prefix") export declare function kv_open_prefix(ids_ptr: usize, n: i32): i32;
@external("symphony", "kv_cache_prefix") export declare function kv_cache_prefix(kv: i32): i32;
@external("symphony", "pred_submit") export declare function pred_submit(kv: i32, ids_ptr: usize, positions_ptr: usize, n: i32, kind: i32, arg: i32): i32;
@external("symphony", "pred_wait") export declare function pred_wait(ticket: i32, out_ptr: usize, cap: i32): i32;
@external("symphony", "pred") export declare function pred(kv: i32, ids_ptr: usize, positions_ptr: usize, n: i32, kind: i32, arg: i32, out_ptr: usize, cap: i32): i32;
@external("symphony", "grammar_new") export declare function grammar_new(kind: i32, source_ptr: usize, source_len: i32): i32;
@external("symphony", "grammar_fork") export declare function grammar_fork(grammar: i32): i32;
@external("symphony", "grammar_accept") export declare function grammar_accept(grammar: i32, ids_ptr: usize, n: i32): i32;
@external("symphony", "grammar_rollback") export declare function grammar_rollback(grammar: i32, n: i32): i32;
@external("symphony", "grammar_state") export declare function grammar_state(grammar: i32): i32;
@external("symphony", "grammar_close") export declare function grammar_close(grammar: i32): i32;
@external("symphony", "send") export declare function send(ptr: usize, len: i32): i32;
@external("symphony", "recv") export declare function recv(out_ptr: usize, cap: i32): i32;
@external("symphony", "tool") export declare function tool(name_ptr: usize, name_len: i32, input_ptr: usize, input_len: i32, out_ptr: usize, cap: i32): i32;

// WASI preview 1, for arguments, stderr and the exit code.
@external("wasi_snapshot_preview1", "args_sizes_get") declare function wasi_args_sizes_get(argc: usize, size: usize): u16;
@external("wasi_snapshot_preview1", "args_get") declare function wasi_args_get(argv: usize, buf: usize): u16;
@external("wasi_snapshot_preview1", "fd_write") declare function wasi_fd_write(fd: u32, iovs: usize, n: usize, written: usize): u16;
@external("wasi_snapshot_preview1", "proc_exit") declare function wasi_proc_exit(code: u32): void;

// ---- error codes (wit/symphony.wit, interface errors) ----
export enum ErrorCode {
  InvalidArgument = -1,
  BadHandle = -2,
  ReadOnly = -3,
  FileExists = -4,
  FileNotFound = -5,
  PermissionDenied = -6,
  PositionError = -7,
  PoolExhausted = -8,
  FileBusy = -9,
  BadPointer = -10,
  BufferTooSmall = -11,
  LimitExceeded = -12,
  Unsupported = -13,
  Internal = -14,
  Closed = -15,
}

const ERROR_NAMES: string[] = [
  "invalid-argument", "bad-handle", "read-only", "file-exists", "file-not-found", "permission-denied",
  "position-error", "pool-exhausted", "file-busy", "bad-pointer", "buffer-too-small", "limit-exceeded",
  "unsupported", "internal", "closed",
];

/** The WIT name of an error code. */
export function errorName(code: i32): string {
  return code < 0 && -code <= ERROR_NAMES.length ? ERROR_NAMES[-code - 1] : "unknown error " + code.toString();
}

/** `code` when >= 0; otherwise ends the process, saying what failed and why. */
export function check(code: i32, what: string): i32 {
  if (code < 0) fail(what + " failed: " + errorName(code));
  return code;
}

export const KV_CREATE: i32 = 1;
export const KV_EXCLUSIVE: i32 = 2;
export const KV_READ_ONLY: i32 = 4;
export const HINT_PINNED: i32 = 1;
export const HINT_DROP_ON_CLOSE: i32 = 2;
const PRED_DIST: i32 = 0;
const PRED_TOPK: i32 = 1;
const PRED_SAMPLE: i32 = 2;
const SAMPLING_SEED: i32 = 1;
const SAMPLING_MORE: i32 = 2;
const PRED_GREEDY_EACH: i32 = 3;
const PRED_SCORE_EACH: i32 = 4;

// ---- process ----

/** Writes to stderr (the process's log). */
export function log(text: string): void {
  const data = String.UTF8.encode(text);
  const iov = new StaticArray<usize>(2);
  iov[0] = changetype<usize>(data);
  iov[1] = <usize>data.byteLength;
  const written = new StaticArray<usize>(1);
  wasi_fd_write(2, changetype<usize>(iov), 1, changetype<usize>(written));
}

export function fail(message: string): void {
  log(message + "\n");
  wasi_proc_exit(1);
}

/** The `abort` of this runtime (pass `--use abort=.../symphony/symphonyAbort`): to the log. */
export function symphonyAbort(message: string | null, file: string | null, line: u32, column: u32): void {
  const what = message !== null ? message : "", where = file !== null ? file : "?";
  log("abort: " + what + " at " + where + ":" + line.toString() + "\n");
  wasi_proc_exit(134);
}

/** The launch arguments, program name first. */
export function args(): string[] {
  const sizes = new StaticArray<usize>(2);
  wasi_args_sizes_get(changetype<usize>(sizes), changetype<usize>(sizes) + sizeof<usize>());
  const count = <i32>sizes[0];
  const pointers = new StaticArray<usize>(count);
  const buffer = new ArrayBuffer(<i32>sizes[1]);
  wasi_args_get(changetype<usize>(pointers), changetype<usize>(buffer));
  const out = new Array<string>();
  for (let i = 0; i < count; i++) {
    const start = pointers[i];
    let end = start;
    while (load<u8>(end) != 0) end++;
    out.push(String.UTF8.decodeUnsafe(start, end - start));
  }
  return out;
}

// ---- model ----

export function vocabSize(): i32 {
  return vocab_size();
}

/** The model's end-of-sequence ids, however many (the host gives the count first). */
export function eosIds(): Int32Array {
  let ids = new Int32Array(8);
  let n = check(eos_ids(ids.dataStart, 8), "eos_ids");
  if (n > 8) {
    ids = new Int32Array(n);
    n = min(check(eos_ids(ids.dataStart, n), "eos_ids"), n);
  }
  return ids.subarray(0, n);
}

export function isEos(token: i32): bool {
  return eosIds().includes(token);
}

// ---- tokens ----

/** Token ids of `text`; with `prompt`, the model's special tokens (BOS) first. */
export function tokenizeText(text: string, prompt: bool = false): Int32Array {
  const data = String.UTF8.encode(text);
  let out = new Int32Array(data.byteLength + 8);
  let n = check(tokenize(changetype<usize>(data), data.byteLength, prompt ? 1 : 0, out.dataStart, out.length), "tokenize");
  if (n > out.length) {
    out = new Int32Array(n);
    n = check(tokenize(changetype<usize>(data), data.byteLength, prompt ? 1 : 0, out.dataStart, out.length), "tokenize");
  }
  return out.subarray(0, n);
}

export function detokenizeIds(ids: Int32Array): string {
  let out = new ArrayBuffer(256);
  let n = check(detokenize(ids.dataStart, ids.length, changetype<usize>(out), out.byteLength), "detokenize");
  if (n > out.byteLength) {
    out = new ArrayBuffer(n);
    n = check(detokenize(ids.dataStart, ids.length, changetype<usize>(out), out.byteLength), "detokenize");
  }
  return String.UTF8.decodeUnsafe(changetype<usize>(out), n);
}

/** The conversation (a JSON list of {"role": ..., "content": ...}) rendered with the model's own
 * chat template, ending with the start of the assistant's turn. Tokenize it with
 * tokenizeText(text, false): the template writes its own special tokens. */
export function chatTemplate(messagesJson: string): string {
  const data = String.UTF8.encode(messagesJson);
  let out = new ArrayBuffer(1024);
  let n = check(chat_template(changetype<usize>(data), data.byteLength, 1, changetype<usize>(out), out.byteLength), "chat_template");
  if (n > out.byteLength) {
    out = new ArrayBuffer(n);
    n = check(chat_template(changetype<usize>(data), data.byteLength, 1, changetype<usize>(out), out.byteLength), "chat_template");
  }
  return String.UTF8.decodeUnsafe(changetype<usize>(out), n);
}

// ---- KV files ----

/** An open KV file handle. Call `close()` when done (anonymous files die with their last handle). */
export class Kv {
  constructor(public handle: i32) {}

  static create(): Kv {
    return new Kv(check(kv_create(), "kv_create"));
  }
  static open(path: string, flags: i32): Kv {
    const data = String.UTF8.encode(path);
    return new Kv(check(kv_open(changetype<usize>(data), data.byteLength, flags), "kv_open " + path));
  }
  /** Automatic prefix reuse: a new file with the longest cached prefix of `ids` (see `length`). */
  static openPrefix(ids: Int32Array): Kv {
    return new Kv(check(kv_open_prefix(ids.dataStart, ids.length), "kv_open_prefix"));
  }
  /** Offers this file's whole pages to the prefix cache; returns how many tokens are cached. */
  cachePrefix(): i32 {
    return check(kv_cache_prefix(this.handle), "kv_cache_prefix");
  }
  static remove(path: string): void {
    const data = String.UTF8.encode(path);
    check(kv_remove(changetype<usize>(data), data.byteLength), "kv_remove " + path);
  }
  fork(): Kv {
    return new Kv(check(kv_fork(this.handle), "kv_fork"));
  }
  extract(start: i32, end: i32): Kv {
    return new Kv(check(kv_extract(this.handle, start, end), "kv_extract"));
  }
  merge(second: Kv): Kv {
    return new Kv(check(kv_merge(this.handle, second.handle), "kv_merge"));
  }
  get length(): i32 {
    return check(kv_len(this.handle), "kv_len");
  }
  truncate(len: i32): void {
    check(kv_truncate(this.handle, len), "kv_truncate");
  }
  /** Eviction hints: flags HINT_*; keepForMs < 0 clears keep-for; lower priority goes first. */
  hint(flags: i32, keepForMs: i32, priority: i32): void {
    check(kv_hint(this.handle, flags, keepForMs, priority), "kv_hint");
  }
  close(): void {
    if (this.handle > 0) kv_close(this.handle);
    this.handle = 0;
  }

  /** Queues a pred for the next-token distribution; several tickets in flight share a batch. */
  submitDistribution(ids: Int32Array): Ticket {
    return new Ticket(check(pred_submit(this.handle, ids.dataStart, 0, ids.length, PRED_DIST, 0), "pred"), 0);
  }
  submitTopK(ids: Int32Array, k: i32): Ticket {
    return new Ticket(check(pred_submit(this.handle, ids.dataStart, 0, ids.length, PRED_TOPK, k), "pred"), k);
  }
  /** Queues a pred that samples on the host (`sampling` null: greedy). */
  submitSample(ids: Int32Array, sampling: Sampling | null = null): Ticket {
    const record = sampling ? sampling.record() : 0;
    return new Ticket(check(pred_submit(this.handle, ids.dataStart, 0, ids.length, PRED_SAMPLE, <i32>record), "pred"), 0);
  }
  /** Appends `ids`; the next-token distribution (one blocking `pred` host call). */
  pred(ids: Int32Array): Float32Array {
    const probs = new Float32Array(vocab_size());
    check(pred(this.handle, ids.dataStart, 0, ids.length, PRED_DIST, 0, probs.dataStart, probs.length), "pred");
    return probs;
  }
  predSample(ids: Int32Array, sampling: Sampling | null = null): i32 {
    const record = sampling ? sampling.record() : 0;
    return check(pred(this.handle, ids.dataStart, 0, ids.length, PRED_SAMPLE, <i32>record, 0, 0), "pred");
  }
  /** Appends `ids`; the greedy next token after each of them (speculative verification). */
  predGreedyEach(ids: Int32Array): Int32Array {
    const out = new Int32Array(ids.length);
    check(pred(this.handle, ids.dataStart, 0, ids.length, PRED_GREEDY_EACH, 0, out.dataStart, out.length), "pred");
    return out;
  }
  /** Appends `ids` (at least 2); each one after the first's log-probability given those before
   *  it (the model's own), then the k most likely there: n - 1 floats, then (n - 1) * k ids,
   *  then their (n - 1) * k log-probabilities (read the floats with reinterpret<f32>). */
  predScoreEach(ids: Int32Array, k: i32): Int32Array {
    const out = new Int32Array((ids.length - 1) * (1 + 2 * k));
    check(pred(this.handle, ids.dataStart, 0, ids.length, PRED_SCORE_EACH, k, out.dataStart, out.length), "pred");
    return out;
  }
}

/** How the host samples: the 48-byte record of the ABI (pred-submit kind 2) and the 24 bytes
 *  that follow it (bit 2 of its has_seed): min-p (0: off) and a repetition penalty (1: off) on
 *  the `penalized` ids. */
export class Sampling {
  temperature: f32 = 0;
  topP: f32 = 1;
  topK: i32 = 0;
  seed: i64 = -1;  // < 0: unseeded
  allowed: Int32Array | null = null;  // constrained decoding
  biasIds: Int32Array | null = null;
  biasValues: Float32Array | null = null;
  minP: f32 = 0;
  repetitionPenalty: f32 = 1;
  penalized: Int32Array | null = null;
  private buffer: ArrayBuffer = new ArrayBuffer(72);

  record(): usize {
    const p = changetype<usize>(this.buffer);
    store<f32>(p, this.temperature);
    store<f32>(p, this.topP, 4);
    store<i32>(p, this.topK, 8);
    store<i32>(p, (this.seed >= 0 ? 1 : 0) | SAMPLING_MORE, 12);
    store<u64>(p, this.seed >= 0 ? <u64>this.seed : 0, 16);
    const allowed = this.allowed;
    store<i32>(p, allowed ? <i32>allowed.dataStart : 0, 24);
    store<i32>(p, allowed ? allowed.length : 0, 28);
    const ids = this.biasIds, values = this.biasValues;
    const nBias = ids && values ? min(ids.length, values.length) : 0;
    store<i32>(p, ids ? <i32>ids.dataStart : 0, 32);
    store<i32>(p, values ? <i32>values.dataStart : 0, 36);
    store<i32>(p, nBias, 40);
    store<i32>(p, 0, 44);
    store<f32>(p, this.minP, 48);
    store<f32>(p, this.repetitionPenalty, 52);
    const penalized = this.penalized;
    store<i32>(p, penalized ? <i32>penalized.dataStart : 0, 56);
    store<i32>(p, penalized ? penalized.length : 0, 60);
    store<i32>(p, 0, 64);
    store<i32>(p, 0, 68);
    return p;
  }
}

/** A pred in flight. */
export class Ticket {
  constructor(public id: i32, private k: i32) {}

  distribution(): Float32Array {
    const probs = new Float32Array(vocab_size());
    check(pred_wait(this.id, probs.dataStart, probs.length), "pred_wait");
    return probs;
  }
  token(): i32 {
    return check(pred_wait(this.id, 0, 0), "pred_wait");
  }
  /** Top-k: k ids then k log-probabilities; returns the ids and fills `logprobs`. */
  top(logprobs: Float32Array): Int32Array {
    const buf = new Int32Array(2 * this.k);
    const n = check(pred_wait(this.id, buf.dataStart, buf.length), "pred_wait");
    for (let i = 0; i < n && i < logprobs.length; i++) logprobs[i] = reinterpret<f32>(buf[n + i]);
    return buf.subarray(0, n);
  }
}

/** The index of the largest probability (the first one on ties; the first NaN if there is one,
 *  as torch.argmax and the C SDK's sym_argmax). */
export function argmax(probs: Float32Array): i32 {
  let best = 0;
  for (let i = 0; i < probs.length; i++) {
    const p = probs[i];
    if (isNaN(p)) return i;
    if (p > probs[best]) best = i;
  }
  return best;
}

// ---- I/O and tools ----

export function sendText(text: string): void {
  const data = String.UTF8.encode(text);
  check(send(changetype<usize>(data), data.byteLength), "send");
}

export function sendBytes(ptr: usize, len: i32): void {
  check(send(ptr, len), "send");
}

/** The next message from the user, or null once the input is closed. */
export function recvText(): string | null {
  let buffer = new ArrayBuffer(4096);
  for (;;) {
    const n = recv(changetype<usize>(buffer), buffer.byteLength);
    if (n == ErrorCode.Closed) return null;
    if (n == ErrorCode.BufferTooSmall) { buffer = new ArrayBuffer(buffer.byteLength * 4); continue; }
    return String.UTF8.decodeUnsafe(changetype<usize>(buffer), check(n, "recv"));
  }
}

/** Calls the operator's tool `name` inside the server. */
export function callTool(name: string, input: string): string {
  const n = String.UTF8.encode(name), i = String.UTF8.encode(input);
  let out = new ArrayBuffer(1024);
  let len = check(tool(changetype<usize>(n), n.byteLength, changetype<usize>(i), i.byteLength, changetype<usize>(out), out.byteLength), "tool " + name);
  if (len > out.byteLength) {
    out = new ArrayBuffer(len);
    len = check(tool(changetype<usize>(n), n.byteLength, changetype<usize>(i), i.byteLength, changetype<usize>(out), out.byteLength), "tool " + name);
  }
  return String.UTF8.decodeUnsafe(changetype<usize>(out), len);
}

// ---- the context helper ----

/** A KV file and the tokens it stands for; tokens from `fed` on are not in the file yet. */
export class Context {
  tokens: Array<i32> = new Array<i32>();
  fed: i32 = 0;
  constructor(public kv: Kv) {}

  static create(): Context {
    return new Context(Kv.create());
  }
  /** Appends text (with BOS when empty); computed with the next pred. */
  fill(text: string): void {
    const ids = tokenizeText(text, this.tokens.length == 0);
    for (let i = 0; i < ids.length; i++) this.tokens.push(ids[i]);
  }
  pending(): Int32Array {
    const out = new Int32Array(this.tokens.length - this.fed);
    for (let i = 0; i < out.length; i++) out[i] = this.tokens[this.fed + i];
    this.fed = this.tokens.length;
    return out;
  }
  /** The next token: argmax of the distribution in the guest (sampling null) or host-sampled. */
  next(sampling: Sampling | null, guestArgmax: bool): i32 {
    const ids = this.pending();
    return guestArgmax ? argmax(this.kv.pred(ids)) : this.kv.predSample(ids, sampling);
  }
  /** Generates up to `maxTokens`, stopping at end of sequence; `onToken` sees each. */
  generate(maxTokens: i32, sampling: Sampling | null, guestArgmax: bool, onToken: (c: Context) => void): void {
    for (let i = 0; i < maxTokens; i++) {
      const token = this.next(sampling, guestArgmax);
      if (isEos(token)) break;
      this.tokens.push(token);
      onToken(this);
    }
  }
  fork(): Context {
    const c = new Context(this.kv.fork());
    c.tokens = this.tokens.slice(0);
    c.fed = this.fed;
    return c;
  }
  ids(from: i32 = 0): Int32Array {
    const out = new Int32Array(this.tokens.length - from);
    for (let i = 0; i < out.length; i++) out[i] = this.tokens[from + i];
    return out;
  }
  text(from: i32 = 0): string {
    return detokenizeIds(this.ids(from));
  }
  close(): void {
    this.kv.close();
  }
}
