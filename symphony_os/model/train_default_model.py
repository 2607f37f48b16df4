"""Train Symphony's default model: a small Llama and its own byte-level BPE tokenizer, on the
Python standard library's own sources (code and docstrings: text every machine with Python has).

    python -m symphony_os.train_default_model [--out symphony_os/default_model] [--steps 1200]

Seeded and deterministic for a given Python version (the corpus is that version's stdlib) on
a given machine; about 20 minutes on 2 CPU cores. Writes a Hugging Face directory (config.json,
model.safetensors, tokenizer files), a loss curve (loss.png, loss.json) and the model card.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import math
import platform
import sys
import sysconfig
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

DEFAULT_OUT = Path(__file__).resolve().parent / "default_model"
BOS, EOS = "<s>", "</s>"
SKIPPED_DIRS = {"test", "tests", "idle_test", "lib2to3", "site-packages", "__pycache__"}


@dataclass(frozen=True)
class TrainConfig:
    """Everything that decides the result. Model shape: 4 layers x 256, GQA 8/4 heads, tied
    embeddings: 3.95M parameters, 16 MB in float32 (measured 4.9k tokens/s training on 2 cores)."""

    seed: int = 0
    vocab_size: int = 4096
    hidden_size: int = 256
    intermediate_size: int = 688
    num_layers: int = 4
    num_heads: int = 8
    num_kv_heads: int = 4
    context: int = 256
    batch_size: int = 16
    steps: int = 1200
    peak_lr: float = 2e-3
    warmup_steps: int = 60
    weight_decay: float = 0.1
    eval_every: int = 100
    holdout_every: int = 40  # every 40th file (sorted by path) is held out for evaluation


def corpus_files(root: Path | None = None) -> list[Path]:
    """The standard library's .py files, sorted, without its test suites and third-party code."""
    root = Path(root or sysconfig.get_paths()["stdlib"])
    return sorted(f for f in root.rglob("*.py") if not SKIPPED_DIRS.intersection(f.relative_to(root).parts))


def read_texts(files: list[Path]) -> list[str]:
    return [f.read_text(encoding="utf-8", errors="replace") for f in files]


def train_tokenizer(texts: list[str], vocab_size: int):
    """A byte-level BPE (every byte string encodes; decoding is exact) with BOS/EOS, wrapped as a
    transformers fast tokenizer that prepends BOS like Llama's."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[BOS, EOS], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer=trainer)
    tok.post_processor = processors.TemplateProcessing(single=f"{BOS} $A", special_tokens=[(BOS, tok.token_to_id(BOS))])
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=BOS, eos_token=EOS, pad_token=EOS,
                                   clean_up_tokenization_spaces=False)


def encode_corpus(tokenizer, texts: list[str]) -> torch.Tensor:
    """One stream of ids: <s> file </s> <s> file </s> ..."""
    ids: list[int] = []
    for text in texts:
        ids.extend(tokenizer.encode(text, add_special_tokens=True))
        ids.append(tokenizer.eos_token_id)
    return torch.tensor(ids, dtype=torch.long)


def build_model(cfg: TrainConfig, tokenizer):
    from transformers import LlamaConfig, LlamaForCausalLM

    hf_config = LlamaConfig(
        vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size, intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_layers, num_attention_heads=cfg.num_heads, num_key_value_heads=cfg.num_kv_heads,
        max_position_embeddings=cfg.context * 8, tie_word_embeddings=True, rope_theta=10000.0,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
    )
    return LlamaForCausalLM(hf_config)


def learning_rate(cfg: TrainConfig, step: int) -> float:
    """Linear warm-up, then cosine decay to a tenth of the peak."""
    if step < cfg.warmup_steps:
        return cfg.peak_lr * (step + 1) / cfg.warmup_steps
    progress = (step - cfg.warmup_steps) / max(1, cfg.steps - cfg.warmup_steps)
    return cfg.peak_lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


def sample_batch(stream: torch.Tensor, cfg: TrainConfig, generator: torch.Generator) -> torch.Tensor:
    starts = torch.randint(0, len(stream) - cfg.context - 1, (cfg.batch_size,), generator=generator)
    return torch.stack([stream[s:s + cfg.context] for s in starts.tolist()])


@torch.no_grad()
def evaluate(model, stream: torch.Tensor, cfg: TrainConfig, windows: int = 32) -> float:
    """Mean next-token loss (nats) over fixed, evenly spaced windows of the held-out stream."""
    model.eval()
    stride = max(1, (len(stream) - cfg.context - 1) // windows)
    batch = torch.stack([stream[i * stride:i * stride + cfg.context] for i in range(windows)])
    loss = model(input_ids=batch, labels=batch).loss.item()
    model.train()
    return loss


def plot_loss(history: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.6), dpi=100)
    ax.plot(history["train_step"], history["train_loss"], lw=0.8, alpha=0.6, label="train (batch)")
    ax.plot(history["eval_step"], history["eval_loss"], "o-", lw=1.5, label="held-out stdlib files")
    ax.set_xlabel("step")
    ax.set_ylabel("next-token loss (nats)")
    ax.set_title("Symphony default model: training on the Python stdlib")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def write_model_card(out: Path, cfg: TrainConfig, facts: dict) -> None:
    card = f"""# symphony-stdlib-4M: Symphony's default model

A small Llama-architecture language model with its own byte-level BPE tokenizer, trained from
scratch on the Python standard library's sources. It ships with Symphony so that `make run`,
`symphony run`, `symphony generate` and `symphony serve` work on a machine with no network.

- **Intended use**: demos and tests of Symphony (it writes recognisable Python: keywords,
  indentation, `self.`, docstrings). It is not a useful code assistant and knows nothing else.
- **Architecture**: Llama, {cfg.num_layers} layers, hidden {cfg.hidden_size}, MLP {cfg.intermediate_size},
  {cfg.num_heads} heads / {cfg.num_kv_heads} KV heads (head dim {cfg.hidden_size // cfg.num_heads}), tied embeddings,
  RoPE, {facts['params'] / 1e6:.2f}M parameters, float32 ({facts['weight_bytes'] / 2**20:.1f} MiB).
- **Tokenizer**: byte-level BPE, {cfg.vocab_size} tokens, `<s>` (id {facts['bos_id']}) prepended, `</s>` (id {facts['eos_id']}) ends a file.
- **Data**: the `.py` files of Python {facts['python']}'s standard library ({facts['files']} files,
  {facts['corpus_mb']:.1f} MB; without `test/`, `tests/`, `idlelib/idle_test`, `lib2to3`, `site-packages`), every
  {cfg.holdout_every}th file held out; {facts['train_tokens'] / 1e6:.2f}M training tokens, {facts['eval_tokens'] / 1e6:.2f}M held out.
  Corpus fingerprint (sha256 of the file list and contents): `{facts['corpus_sha256'][:16]}`.
- **Training**: {cfg.steps} steps of {cfg.batch_size} x {cfg.context} tokens ({facts['tokens_seen'] / 1e6:.1f}M tokens),
  AdamW (peak lr {cfg.peak_lr}, warm-up {cfg.warmup_steps}, cosine to 10%, weight decay {cfg.weight_decay}),
  seed {cfg.seed}; {facts['train_minutes']:.1f} minutes on {facts['machine']}.
- **Result**: held-out loss {facts['final_eval_loss']:.3f} nats/token (perplexity {math.exp(facts['final_eval_loss']):.1f});
  it started at {facts['first_eval_loss']:.3f}. Curve: `loss.png` (data in `loss.json`).
- **Reproduce**: `make default-model` (runs `python -m symphony_os.train_default_model`).
- **License**: the weights are derived from the Python standard library (PSF License); released under the same terms.

![loss curve](loss.png)
"""
    (out / "README.md").write_text(card)


def train(cfg: TrainConfig, out: Path) -> dict:
    from tqdm import tqdm

    torch.manual_seed(cfg.seed)
    started = time.perf_counter()
    files = corpus_files()
    texts = read_texts(files)
    digest = hashlib.sha256()
    for f, text in zip(files, texts):
        digest.update(f.name.encode() + b"\0" + text.encode())
    train_texts = [t for i, t in enumerate(texts) if i % cfg.holdout_every]
    eval_texts = [t for i, t in enumerate(texts) if not i % cfg.holdout_every]
    print(f"corpus: {len(files)} files, {sum(map(len, texts)) / 1e6:.1f} MB; training the tokenizer", flush=True)
    tokenizer = train_tokenizer(train_texts, cfg.vocab_size)
    train_stream, eval_stream = encode_corpus(tokenizer, train_texts), encode_corpus(tokenizer, eval_texts)
    print(f"tokens: {len(train_stream) / 1e6:.2f}M train, {len(eval_stream) / 1e6:.2f}M held out", flush=True)

    model = build_model(cfg, tokenizer)
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": cfg.weight_decay},
                                   {"params": no_decay, "weight_decay": 0.0}],
                                  lr=cfg.peak_lr, betas=(0.9, 0.95), eps=1e-8)
    generator = torch.Generator().manual_seed(cfg.seed)
    history = {"train_step": [], "train_loss": [], "eval_step": [], "eval_loss": []}
    model.train()
    bar = tqdm(range(cfg.steps), desc="training", unit="step")
    for step in bar:
        if step % cfg.eval_every == 0:
            history["eval_step"].append(step)
            history["eval_loss"].append(evaluate(model, eval_stream, cfg))
        for group in optimizer.param_groups:
            group["lr"] = learning_rate(cfg, step)
        batch = sample_batch(train_stream, cfg, generator)
        loss = model(input_ids=batch, labels=batch).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        history["train_step"].append(step)
        history["train_loss"].append(loss.item())
        bar.set_postfix(loss=f"{loss.item():.3f}", eval=f"{history['eval_loss'][-1]:.3f}")
    history["eval_step"].append(cfg.steps)
    history["eval_loss"].append(evaluate(model, eval_stream, cfg))

    out.mkdir(parents=True, exist_ok=True)
    model.generation_config.do_sample = False
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    (out / "loss.json").write_text(json.dumps({"config": asdict(cfg), **history}))
    plot_loss(history, out / "loss.png")
    facts = {
        "params": sum(p.numel() for p in model.parameters()),
        "weight_bytes": (out / "model.safetensors").stat().st_size,
        "bos_id": tokenizer.bos_token_id, "eos_id": tokenizer.eos_token_id,
        "python": platform.python_version(), "files": len(files), "corpus_mb": sum(map(len, texts)) / 1e6,
        "corpus_sha256": digest.hexdigest(), "train_tokens": len(train_stream), "eval_tokens": len(eval_stream),
        "tokens_seen": cfg.steps * cfg.batch_size * cfg.context,
        "train_minutes": (time.perf_counter() - started) / 60,
        "machine": f"{torch.get_num_threads()} CPU thread{'s' if torch.get_num_threads() > 1 else ''} "
                   f"({platform.machine()}, {platform.processor() or 'cpu'})",
        "first_eval_loss": history["eval_loss"][0], "final_eval_loss": history["eval_loss"][-1],
    }
    write_model_card(out, cfg, facts)
    return facts


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="where to write the model directory")
    parser.add_argument("--steps", type=int, default=TrainConfig.steps, help="optimizer steps")
    parser.add_argument("--seed", type=int, default=TrainConfig.seed)
    parser.add_argument("--threads", type=int, default=None,
                        help="torch CPU threads (default: all cores; 1 is faster when other jobs share the cores)")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    facts = train(TrainConfig(steps=args.steps, seed=args.seed), args.out)
    print(f"saved {args.out}: held-out loss {facts['first_eval_loss']:.3f} -> {facts['final_eval_loss']:.3f} "
          f"in {facts['train_minutes']:.1f} min", file=sys.stderr)


if __name__ == "__main__":
    main()
