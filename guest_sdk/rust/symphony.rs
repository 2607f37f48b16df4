//! symphony.rs: the Rust SDK for Symphony LLM Inference Programs (LIPs). Standard library only.
//!
//! A LIP is a WASI preview-1 command built from one crate that includes this file as a module:
//!
//! ```text
//! #[path = "../../guest_sdk/rust/symphony.rs"] mod symphony;
//! /usr/bin/rustc --edition 2021 --target wasm32-wasi -O prog.rs -o prog.wasm
//! ```
//!
//! The system calls of `wit/symphony.wit` are in [`sys`], raw; the rest wraps them safely:
//! errors are [`Error`] values instead of negative codes, a [`Kv`] closes its file when dropped,
//! a [`Ticket`] is a pred in flight, and [`Context`] keeps a KV file and its tokens together
//! (fill, generate until a stop, fork).
//!
//! WASI gives args, env, clocks, random, `std::thread::sleep` (the process waits, suspended; the
//! others run) and stdout/stderr (the process's log).
#![allow(dead_code)]

/// The raw imports of module `symphony` (wit/symphony.wit): i32 in, i32 out; negative is an error.
pub mod sys {
    #[link(wasm_import_module = "symphony")]
    extern "C" {
        pub fn vocab_size() -> i32;
        pub fn eos_ids(out_ptr: *mut i32, cap: i32) -> i32;
        pub fn bos_id() -> i32;
        pub fn model_name(out_ptr: *mut u8, cap: i32) -> i32;
        pub fn tokenize(text_ptr: *const u8, text_len: i32, flags: i32, out_ptr: *mut i32, cap: i32) -> i32;
        pub fn detokenize(ids_ptr: *const i32, n: i32, out_ptr: *mut u8, cap: i32) -> i32;
        pub fn chat_template(messages_ptr: *const u8, messages_len: i32, flags: i32, out_ptr: *mut u8, cap: i32) -> i32;
        pub fn kv_create() -> i32;
        pub fn kv_open(path_ptr: *const u8, path_len: i32, flags: i32) -> i32;
        pub fn kv_fork(kv: i32) -> i32;
        pub fn kv_extract(kv: i32, start: i32, end: i32) -> i32;
        pub fn kv_merge(first: i32, second: i32) -> i32;
        pub fn kv_len(kv: i32) -> i32;
        pub fn kv_truncate(kv: i32, len: i32) -> i32;
        pub fn kv_close(kv: i32) -> i32;
        pub fn kv_remove(path_ptr: *const u8, path_len: i32) -> i32;
        pub fn kv_hint(kv: i32, flags: i32, keep_for_ms: i32, priority: i32) -> i32;
        pub fn kv_open_prefix(ids_ptr: *const i32, n: i32) -> i32;
        pub fn kv_cache_prefix(kv: i32) -> i32;
        pub fn pred_submit(kv: i32, ids_ptr: *const i32, positions_ptr: *const i32, n: i32, kind: i32, arg: i32) -> i32;
        pub fn pred_wait(ticket: i32, out_ptr: *mut u8, cap: i32) -> i32;
        pub fn pred(kv: i32, ids_ptr: *const i32, positions_ptr: *const i32, n: i32, kind: i32, arg: i32, out_ptr: *mut u8, cap: i32) -> i32;
        pub fn grammar_new(kind: i32, source_ptr: *const u8, source_len: i32) -> i32;
        pub fn grammar_fork(grammar: i32) -> i32;
        pub fn grammar_accept(grammar: i32, ids_ptr: *const i32, n: i32) -> i32;
        pub fn grammar_rollback(grammar: i32, n: i32) -> i32;
        pub fn grammar_state(grammar: i32) -> i32;
        pub fn grammar_close(grammar: i32) -> i32;
        pub fn send(ptr: *const u8, len: i32) -> i32;
        pub fn recv(out_ptr: *mut u8, cap: i32) -> i32;
        pub fn tool(name_ptr: *const u8, name_len: i32, input_ptr: *const u8, input_len: i32, out_ptr: *mut u8, cap: i32) -> i32;
    }
}

/// The error table of wit/symphony.wit (interface errors); the value is the ABI code.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Error {
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

const ERRORS: [Error; 15] = [
    Error::InvalidArgument, Error::BadHandle, Error::ReadOnly, Error::FileExists, Error::FileNotFound,
    Error::PermissionDenied, Error::PositionError, Error::PoolExhausted, Error::FileBusy, Error::BadPointer,
    Error::BufferTooSmall, Error::LimitExceeded, Error::Unsupported, Error::Internal, Error::Closed,
];

pub type Result<T> = std::result::Result<T, Error>;

/// A host call's i32: the value when >= 0, else its error (unknown codes are `Internal`).
pub fn check(code: i32) -> Result<i32> {
    if code >= 0 {
        Ok(code)
    } else {
        Err(ERRORS.get((-code - 1) as usize).copied().unwrap_or(Error::Internal))
    }
}

/// kv_open flags.
pub const KV_CREATE: i32 = 1;
pub const KV_EXCLUSIVE: i32 = 2;
pub const KV_READ_ONLY: i32 = 4;
/// kv_hint flags.
pub const HINT_PINNED: i32 = 1;
pub const HINT_DROP_ON_CLOSE: i32 = 2;
/// pred kinds.
const PRED_DIST: i32 = 0;
const PRED_TOPK: i32 = 1;
const PRED_SAMPLE: i32 = 2;
const SAMPLING_SEED: i32 = 1;
const SAMPLING_MORE: i32 = 2;
const PRED_GREEDY_EACH: i32 = 3;
const PRED_SCORE_EACH: i32 = 4;

// ---- model ----

/// Tokens in the vocabulary: the length of a distribution.
pub fn vocab_size() -> usize {
    unsafe { sys::vocab_size() }.max(0) as usize
}

/// The model's end-of-sequence ids, however many (the host gives the count first).
pub fn eos_ids() -> Vec<u32> {
    let mut ids = vec![0i32; 8];
    loop {
        let n = unsafe { sys::eos_ids(ids.as_mut_ptr(), ids.len() as i32) }.max(0) as usize;
        if n <= ids.len() {
            return ids[..n].iter().map(|&i| i as u32).collect();
        }
        ids = vec![0i32; n];
    }
}

pub fn bos_id() -> Option<u32> {
    check(unsafe { sys::bos_id() }).ok().map(|i| i as u32)
}

pub fn model_name() -> Result<String> {
    read_text(|out, cap| unsafe { sys::model_name(out, cap) })
}

// ---- tokens ----

/// Token ids of `text`; with `prompt`, with the model's special tokens (BOS) first.
pub fn tokenize(text: &str, prompt: bool) -> Result<Vec<u32>> {
    let mut out = vec![0i32; text.len() + 8];
    loop {
        let n = check(unsafe {
            sys::tokenize(text.as_ptr(), text.len() as i32, prompt as i32, out.as_mut_ptr(), out.len() as i32)
        })? as usize;
        if n <= out.len() {
            return Ok(out[..n].iter().map(|&i| i as u32).collect());
        }
        out.resize(n, 0);
    }
}

pub fn detokenize(ids: &[u32]) -> Result<String> {
    read_text(|out, cap| unsafe { sys::detokenize(ids.as_ptr() as *const i32, ids.len() as i32, out, cap) })
}

/// The conversation (`messages_json`: a JSON list of {"role": ..., "content": ...}) rendered with
/// the model's own chat template, ending with the start of the assistant's turn. Tokenize it
/// with `tokenize` (no BOS): the template writes its own special tokens.
pub fn chat_template(messages_json: &str) -> Result<String> {
    read_text(|out, cap| unsafe {
        sys::chat_template(messages_json.as_ptr(), messages_json.len() as i32, 1, out, cap)
    })
}

/// Calls a host function that writes up to `cap` bytes and returns the full length.
fn read_text(call: impl Fn(*mut u8, i32) -> i32) -> Result<String> {
    let mut out = vec![0u8; 256];
    loop {
        let n = check(call(out.as_mut_ptr(), out.len() as i32))? as usize;
        if n <= out.len() {
            out.truncate(n);
            return Ok(String::from_utf8_lossy(&out).into_owned());
        }
        out.resize(n, 0);
    }
}

// ---- KV files ----

/// An open KV file handle; closed when dropped.
#[derive(Debug)]
pub struct Kv(i32);

impl Kv {
    /// A new empty anonymous file.
    pub fn create() -> Result<Kv> {
        check(unsafe { sys::kv_create() }).map(Kv)
    }
    /// Opens a named file (`KV_CREATE | KV_EXCLUSIVE | KV_READ_ONLY`).
    pub fn open(path: &str, flags: i32) -> Result<Kv> {
        check(unsafe { sys::kv_open(path.as_ptr(), path.len() as i32, flags) }).map(Kv)
    }
    /// A new anonymous file with the same tokens; pages shared copy-on-write.
    pub fn fork(&self) -> Result<Kv> {
        check(unsafe { sys::kv_fork(self.0) }).map(Kv)
    }
    /// A new anonymous file holding tokens [start, end).
    pub fn extract(&self, start: usize, end: usize) -> Result<Kv> {
        check(unsafe { sys::kv_extract(self.0, start as i32, end as i32) }).map(Kv)
    }
    /// A new anonymous file: this file's tokens, then `second`'s.
    pub fn merge(&self, second: &Kv) -> Result<Kv> {
        check(unsafe { sys::kv_merge(self.0, second.0) }).map(Kv)
    }
    pub fn len(&self) -> Result<usize> {
        check(unsafe { sys::kv_len(self.0) }).map(|n| n as usize)
    }
    pub fn truncate(&self, len: usize) -> Result<()> {
        check(unsafe { sys::kv_truncate(self.0, len as i32) }).map(drop)
    }
    /// Eviction hints: flags `HINT_*`; `keep_for_ms` None clears keep-for; lower priority goes first.
    pub fn hint(&self, flags: i32, keep_for_ms: Option<u32>, priority: i32) -> Result<()> {
        let keep = keep_for_ms.map(|ms| ms.min(i32::MAX as u32) as i32).unwrap_or(-1);
        check(unsafe { sys::kv_hint(self.0, flags, keep, priority) }).map(drop)
    }
    /// Automatic prefix reuse: a new file holding the longest prefix of `ids` the tenant's
    /// prefix cache has (`len()` says how long; 0 when none).
    pub fn open_prefix(ids: &[u32]) -> Result<Kv> {
        check(unsafe { sys::kv_open_prefix(ids.as_ptr() as *const i32, ids.len() as i32) }).map(Kv)
    }
    /// Offers this file's whole pages (a file from `open_prefix`) to the prefix cache; returns
    /// how many tokens are cached.
    pub fn cache_prefix(&self) -> Result<usize> {
        check(unsafe { sys::kv_cache_prefix(self.0) }).map(|n| n as usize)
    }
    /// Removes a name (the file lives while the owner's handles remain open; other tenants' are closed).
    pub fn remove(path: &str) -> Result<()> {
        check(unsafe { sys::kv_remove(path.as_ptr(), path.len() as i32) }).map(drop)
    }
    /// The raw handle.
    pub fn handle(&self) -> i32 {
        self.0
    }

    fn submit(&self, ids: &[u32], kind: i32, arg: i32) -> Result<Ticket> {
        let n = ids.len() as i32;
        check(unsafe { sys::pred_submit(self.0, ids.as_ptr() as *const i32, std::ptr::null(), n, kind, arg) })
            .map(|t| Ticket { id: t, kind, arg })
    }
    /// Queues a pred for the next-token distribution; several tickets in flight share a batch.
    pub fn submit_dist(&self, ids: &[u32]) -> Result<Ticket> {
        self.submit(ids, PRED_DIST, 0)
    }
    pub fn submit_topk(&self, ids: &[u32], k: usize) -> Result<Ticket> {
        self.submit(ids, PRED_TOPK, k as i32)
    }
    /// Queues a pred that samples on the host; the record is read at submit time.
    pub fn submit_sample(&self, ids: &[u32], sampling: &Sampling) -> Result<Ticket> {
        let record = sampling.record();
        self.submit(ids, PRED_SAMPLE, &record as *const SamplingRecord as i32)
    }
    pub fn submit_greedy_each(&self, ids: &[u32]) -> Result<Ticket> {
        self.submit(ids, PRED_GREEDY_EACH, 0)
    }
    /// One blocking `pred` (submit and wait in one host call) with room for `len` values.
    fn pred_into<T: Default + Clone>(&self, ids: &[u32], kind: i32, arg: i32, len: usize) -> Result<(Vec<T>, usize)> {
        let mut out = vec![T::default(); len];
        let n = check(unsafe {
            sys::pred(self.0, ids.as_ptr() as *const i32, std::ptr::null(), ids.len() as i32, kind, arg,
                      out.as_mut_ptr() as *mut u8, len as i32)
        })?;
        Ok((out, n as usize))
    }
    /// Appends `ids`; the next-token distribution (vocab_size() probabilities).
    pub fn pred(&self, ids: &[u32]) -> Result<Vec<f32>> {
        self.pred_into::<f32>(ids, PRED_DIST, 0, vocab_size()).map(|(probs, _)| probs)
    }
    /// Appends `ids`; one token sampled on the host.
    pub fn pred_sample(&self, ids: &[u32], sampling: &Sampling) -> Result<u32> {
        let record = sampling.record();
        self.pred_into::<u32>(ids, PRED_SAMPLE, &record as *const SamplingRecord as i32, 0).map(|(_, token)| token as u32)
    }
    /// Appends `ids`; the k most likely (id, log-probability), most likely first.
    pub fn pred_topk(&self, ids: &[u32], k: usize) -> Result<Vec<(u32, f32)>> {
        let (buf, n) = self.pred_into::<u32>(ids, PRED_TOPK, k as i32, 2 * k)?;
        Ok((0..n).map(|i| (buf[i], f32::from_bits(buf[n + i]))).collect())
    }
    /// Appends `ids`; the greedy next token after each of them (speculative verification).
    pub fn pred_greedy_each(&self, ids: &[u32]) -> Result<Vec<u32>> {
        let (buf, n) = self.pred_into::<u32>(ids, PRED_GREEDY_EACH, 0, ids.len())?;
        Ok(buf[..n].to_vec())
    }
    /// Appends `ids` (at least 2); for each after the first, its log-probability given those
    /// before it, with the k most likely (id, log-probability) there: the model's own.
    pub fn pred_score_each(&self, ids: &[u32], k: usize) -> Result<Vec<(f32, Vec<(u32, f32)>)>> {
        let scored = ids.len().saturating_sub(1);
        let (buf, n) = self.pred_into::<u32>(ids, PRED_SCORE_EACH, k as i32, scored * (1 + 2 * k))?;
        Ok((0..n)
            .map(|i| {
                let top = (0..k).map(|j| (buf[n + i * k + j], f32::from_bits(buf[n + n * k + i * k + j])));
                (f32::from_bits(buf[i]), top.collect())
            })
            .collect())
    }
}

impl Drop for Kv {
    fn drop(&mut self) {
        unsafe { sys::kv_close(self.0) };
    }
}

// ---- grammars (constrained decoding) ----

/// A grammar the host keeps (llguidance): from a JSON schema, a regex or a Lark grammar; freed
/// when dropped. Put its `handle()` in a `Sampling`'s `grammar`.
#[derive(Debug)]
pub struct Grammar(i32);

pub const GRAMMAR_JSON_SCHEMA: i32 = 0;
pub const GRAMMAR_REGEX: i32 = 1;
pub const GRAMMAR_LARK: i32 = 2;

impl Grammar {
    pub fn new(kind: i32, source: &str) -> Result<Grammar> {
        check(unsafe { sys::grammar_new(kind, source.as_ptr(), source.len() as i32) }).map(Grammar)
    }
    pub fn fork(&self) -> Result<Grammar> {
        check(unsafe { sys::grammar_fork(self.0) }).map(Grammar)
    }
    /// Moves it on by tokens the program chose: all, or none and an error.
    pub fn accept(&self, ids: &[u32]) -> Result<()> {
        check(unsafe { sys::grammar_accept(self.0, ids.as_ptr() as *const i32, ids.len() as i32) }).map(|_| ())
    }
    pub fn rollback(&self, n: usize) -> Result<()> {
        check(unsafe { sys::grammar_rollback(self.0, n as i32) }).map(|_| ())
    }
    /// May the text end here?
    pub fn may_end(&self) -> Result<bool> {
        check(unsafe { sys::grammar_state(self.0) }).map(|state| state & 1 != 0)
    }
    /// Must it end here?
    pub fn must_end(&self) -> Result<bool> {
        check(unsafe { sys::grammar_state(self.0) }).map(|state| state & 2 != 0)
    }
    pub fn handle(&self) -> i32 {
        self.0
    }
}

impl Drop for Grammar {
    fn drop(&mut self) {
        unsafe { sys::grammar_close(self.0) };
    }
}

// ---- prediction ----

/// How the host samples a token. `Sampling::default()` is greedy.
#[derive(Debug, Clone, Default)]
pub struct Sampling {
    pub temperature: f32,
    pub top_p: f32, // 0 is taken as 1 (off)
    pub top_k: u32,
    pub seed: Option<u64>,
    /// Constrained decoding: only these ids may be chosen.
    pub allowed: Option<Vec<u32>>,
    /// Logit bias: (id, value added to its logit).
    pub bias_ids: Vec<u32>,
    pub bias_values: Vec<f32>,
    /// A grammar's handle (`Grammar::handle`): the draw keeps to what it allows next and moves it on.
    pub grammar: Option<i32>,
    /// After the temperature, only the tokens at least min_p times as likely as the best (0: off).
    pub min_p: f32,
    /// Divides a positive logit of the `penalized` ids, multiplies a negative one (0 is taken as 1: off).
    pub repetition_penalty: f32,
    pub penalized: Vec<u32>,
}

/// The 48-byte sampling record of the ABI (wit/symphony.wit, pred-submit kind 2) and the
/// 24 bytes that follow it (its has_seed's bit 2): min-p and the repetition penalty.
#[repr(C)]
struct SamplingRecord {
    temperature: f32,
    top_p: f32,
    top_k: i32,
    has_seed: i32,
    seed: u64,
    allowed: i32,
    n_allowed: i32,
    bias_ids: i32,
    bias_values: i32,
    n_bias: i32,
    grammar: i32,
    min_p: f32,
    repetition_penalty: f32,
    penalized: i32,
    n_penalized: i32,
    logprobs: i32,
    top_logprobs: i32,
}

impl Sampling {
    pub fn greedy() -> Sampling {
        Sampling::default()
    }
    pub fn temperature(temperature: f32, seed: u64) -> Sampling {
        Sampling { temperature, seed: Some(seed), ..Sampling::default() }
    }
    fn record(&self) -> SamplingRecord {
        let allowed = self.allowed.as_deref().unwrap_or(&[]);
        SamplingRecord {
            temperature: self.temperature,
            top_p: if self.top_p > 0.0 { self.top_p } else { 1.0 },
            top_k: self.top_k as i32,
            has_seed: self.seed.is_some() as i32 | SAMPLING_MORE,
            seed: self.seed.unwrap_or(0),
            allowed: if self.allowed.is_some() { allowed.as_ptr() as i32 } else { 0 },
            n_allowed: allowed.len() as i32,
            bias_ids: self.bias_ids.as_ptr() as i32,
            bias_values: self.bias_values.as_ptr() as i32,
            n_bias: self.bias_ids.len().min(self.bias_values.len()) as i32,
            grammar: self.grammar.unwrap_or(0),
            min_p: self.min_p,
            repetition_penalty: if self.repetition_penalty > 0.0 { self.repetition_penalty } else { 1.0 },
            penalized: self.penalized.as_ptr() as i32,
            n_penalized: self.penalized.len() as i32,
            logprobs: 0,
            top_logprobs: 0,
        }
    }
}

/// A pred in flight: wait for it with the method matching how it was submitted.
#[derive(Debug)]
pub struct Ticket {
    id: i32,
    kind: i32,
    arg: i32,
}

impl Ticket {
    fn wait_into<T: Default + Clone>(&self, len: usize) -> Result<(Vec<T>, usize)> {
        let mut out = vec![T::default(); len];
        let n = check(unsafe { sys::pred_wait(self.id, out.as_mut_ptr() as *mut u8, len as i32) })?;
        Ok((out, n as usize))
    }
    pub fn distribution(self) -> Result<Vec<f32>> {
        self.wait_into::<f32>(vocab_size()).map(|(probs, _)| probs)
    }
    pub fn token(self) -> Result<u32> {
        check(unsafe { sys::pred_wait(self.id, std::ptr::null_mut(), 0) }).map(|t| t as u32)
    }
    pub fn top(self) -> Result<Vec<(u32, f32)>> {
        let k = self.arg as usize;
        let (buf, n) = self.wait_into::<u32>(2 * k)?;
        Ok((0..n).map(|i| (buf[i], f32::from_bits(buf[n + i]))).collect())
    }
    pub fn tokens(self) -> Result<Vec<u32>> {
        let (buf, n) = self.wait_into::<u32>(1 << 16)?;
        Ok(buf[..n].to_vec())
    }
}

/// The index of the largest probability (the first one on ties; the first NaN if there is one).
pub fn argmax(probs: &[f32]) -> u32 {
    let mut best = 0;
    for (i, &p) in probs.iter().enumerate() {
        if p.is_nan() {
            return i as u32; // as torch.argmax and the C SDK's sym_argmax: a NaN is the maximum
        }
        if p > probs[best] {
            best = i;
        }
    }
    best as u32
}

/// Is `token` one of the model's end-of-sequence ids?
pub fn is_eos(token: u32) -> bool {
    eos_ids().contains(&token)
}

// ---- I/O and tools ----

/// Sends bytes to the process's user.
pub fn send(data: &[u8]) -> Result<()> {
    check(unsafe { sys::send(data.as_ptr(), data.len() as i32) }).map(drop)
}

pub fn send_str(text: &str) -> Result<()> {
    send(text.as_bytes())
}

/// The next message from the user; None once the user closed the input.
pub fn recv() -> Result<Option<Vec<u8>>> {
    let mut out = vec![0u8; 4096];
    loop {
        match check(unsafe { sys::recv(out.as_mut_ptr(), out.len() as i32) }) {
            Ok(n) => {
                out.truncate(n as usize);
                return Ok(Some(out));
            }
            Err(Error::BufferTooSmall) => out.resize(out.len() * 4, 0),
            Err(Error::Closed) => return Ok(None),
            Err(error) => return Err(error),
        }
    }
}

/// Calls the operator's tool `name` inside the server.
pub fn tool(name: &str, input: &str) -> Result<String> {
    read_text(|out, cap| unsafe {
        sys::tool(name.as_ptr(), name.len() as i32, input.as_ptr(), input.len() as i32, out, cap)
    })
}

// ---- the context helper ----

/// How a context picks its next token.
pub enum Sampler {
    /// The whole distribution comes to the guest, which takes its argmax.
    Argmax,
    /// The host samples (greedy, temperature, constrained, biased).
    Host(Sampling),
}

/// A KV file and the tokens it stands for. Every token but the last `pending` ones is in the
/// file; the next pred feeds the pending ones.
pub struct Context {
    pub kv: Kv,
    pub tokens: Vec<u32>,
    fed: usize,
}

impl Context {
    pub fn new() -> Result<Context> {
        Ok(Context { kv: Kv::create()?, tokens: Vec::new(), fed: 0 })
    }
    /// Appends text (with BOS when the context is empty); computed with the next pred.
    pub fn fill(&mut self, text: &str) -> Result<()> {
        let ids = tokenize(text, self.tokens.is_empty())?;
        self.fill_tokens(&ids);
        Ok(())
    }
    pub fn fill_tokens(&mut self, ids: &[u32]) {
        self.tokens.extend_from_slice(ids);
    }
    /// Computes what is pending and returns the next token (not yet appended).
    pub fn next_token(&mut self, sampler: &Sampler) -> Result<u32> {
        let pending = &self.tokens[self.fed..];
        let token = match sampler {
            Sampler::Argmax => argmax(&self.kv.pred(pending)?),
            Sampler::Host(sampling) => self.kv.pred_sample(pending, sampling)?,
        };
        self.fed = self.tokens.len();
        Ok(token)
    }
    /// Generates up to `max_tokens` tokens, stopping at end of sequence or when `stop` says so
    /// (it sees the tokens generated so far); calls `on_token` with each. Returns them.
    pub fn generate_until(&mut self, sampler: &Sampler, max_tokens: usize, mut on_token: impl FnMut(&Context, u32),
                          stop: impl Fn(&[u32]) -> bool) -> Result<Vec<u32>> {
        let start = self.tokens.len();
        for _ in 0..max_tokens {
            let token = self.next_token(sampler)?;
            if is_eos(token) {
                break;
            }
            self.tokens.push(token);
            on_token(self, token);
            if stop(&self.tokens[start..]) {
                break;
            }
        }
        Ok(self.tokens[start..].to_vec())
    }
    /// A second context sharing this one's KV pages (copy-on-write) and tokens.
    pub fn fork(&self) -> Result<Context> {
        Ok(Context { kv: self.kv.fork()?, tokens: self.tokens.clone(), fed: self.fed })
    }
    /// Queues the pending tokens with a host-sampling pred, for parallel decoding: submit on
    /// several contexts, then `accept` each ticket's token.
    pub fn submit(&mut self, sampling: &Sampling) -> Result<Ticket> {
        let ticket = self.kv.submit_sample(&self.tokens[self.fed..], sampling)?;
        self.fed = self.tokens.len();
        Ok(ticket)
    }
    pub fn text(&self) -> Result<String> {
        detokenize(&self.tokens)
    }
}

/// Streams a token sequence's text: sends what is new since the last call.
pub struct TextStream {
    sent: usize,
}

impl TextStream {
    pub fn new() -> TextStream {
        TextStream { sent: 0 }
    }
    /// Sends what `tokens` decode to beyond what was sent, but for a character whose tokens
    /// have not all come yet (it decodes as U+FFFD, one per byte so far, until complete).
    pub fn update(&mut self, tokens: &[u32]) -> Result<()> {
        let text = detokenize(tokens)?;
        self.send_beyond(text.trim_end_matches('\u{FFFD}'))
    }
    /// Sends what `update` held back at the end: a character whose tokens never all came.
    pub fn finish(&mut self, tokens: &[u32]) -> Result<()> {
        let text = detokenize(tokens)?;
        self.send_beyond(&text)
    }
    fn send_beyond(&mut self, text: &str) -> Result<()> {
        if text.len() > self.sent {
            send(&text.as_bytes()[self.sent..])?;
            self.sent = text.len();
        }
        Ok(())
    }
}
