"""A Llama-family decoder (Llama 2/3, Mistral, Qwen2/2.5, Qwen3) that reads and writes K/V
through the paged pool.

One model for every device; attention goes through a backend from `attention.py`. Q/K/V and
gate/up projections are fused into one matrix each at load time: fewer, larger matmuls.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from ..kv.pool import KVPool
from .attention import AttentionMetadata
from .linear import Linear


@dataclass
class ModelConfig:
    """The shape of a decoder, read from a transformers config."""

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    hidden_act: str = "silu"
    sliding_window: int | None = None
    # Layers that attend to the whole context although the model has a window (Qwen2/3 slide only
    # the layers their config's layer_types marks; Mistral slides every layer).
    full_attention_layers: tuple[int, ...] = ()

    @classmethod
    def from_hf(cls, config) -> "ModelConfig":
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        use_window = getattr(config, "use_sliding_window", True)  # Qwen2 keeps a window it does not use
        window = (getattr(config, "sliding_window", None) or None) if use_window else None
        layer_types = (getattr(config, "layer_types", None) or ()) if window else ()
        full_layers = tuple(i for i, kind in enumerate(layer_types) if kind != "sliding_attention")
        if len(full_layers) == config.num_hidden_layers:
            window, full_layers = None, ()
        return cls(
            model_type=config.model_type,
            vocab_size=config.vocab_size,
            hidden_size=config.hidden_size,
            intermediate_size=config.intermediate_size,
            num_layers=config.num_hidden_layers,
            num_heads=config.num_attention_heads,
            num_kv_heads=getattr(config, "num_key_value_heads", None) or config.num_attention_heads,
            head_dim=head_dim,
            rms_norm_eps=config.rms_norm_eps,
            max_position_embeddings=config.max_position_embeddings,
            tie_word_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
            hidden_act=config.hidden_act,
            sliding_window=window,
            full_attention_layers=full_layers,
        )

    @property
    def num_params(self) -> int:
        attn = self.hidden_size * self.head_dim * (2 * self.num_heads + 2 * self.num_kv_heads)
        mlp = 3 * self.hidden_size * self.intermediate_size
        embed = self.vocab_size * self.hidden_size * (1 if self.tie_word_embeddings else 2)
        return self.num_layers * (attn + mlp) + embed


def rope_parameters(hf_config) -> dict:
    """The config's RoPE parameters: `rope_parameters` in transformers 5, `rope_scaling` before
    (where the type may be under the legacy key `type`), with `rope_type` always set."""
    params = dict(getattr(hf_config, "rope_parameters", None) or getattr(hf_config, "rope_scaling", None) or {})
    params["rope_type"] = params.get("rope_type") or params.get("type") or "default"
    return params


def rope_inv_freq(hf_config) -> tuple[torch.Tensor, float]:
    """Inverse RoPE frequencies and the cos/sin scale, as transformers computes them."""
    params = rope_parameters(hf_config)
    rope_type = params["rope_type"]
    if rope_type == "default":
        head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // hf_config.num_attention_heads
        base = params.get("rope_theta", getattr(hf_config, "rope_theta", 10000.0))
        return 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float) / head_dim)), 1.0
    inv_freq, scale = ROPE_INIT_FUNCTIONS[rope_type](hf_config, "cpu")
    return inv_freq.float(), float(scale)


# The elementwise steps below take `kernel`: True runs the Triton kernel (the model's choice on
# CUDA; tests run it on the CPU under TRITON_INTERPRET), False torch's own ops.

def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, kernel: bool = False) -> torch.Tensor:
    if kernel:  # one fused kernel instead of eight
        from ..kernels.norm_rope import rms_norm as fused_rms_norm
        return fused_rms_norm(x, weight, eps)
    # In float32 like transformers, then back: keeps logits within 1e-4 of the reference.
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
                 kernel: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(residual + x), residual + x): a sublayer's output added to the residual
    stream, and the norm of the sum, which the next sublayer reads."""
    if kernel:  # one kernel instead of two
        from ..kernels.norm_rope import add_rms_norm as fused_add_rms_norm
        return fused_add_rms_norm(x, residual, weight, eps)
    summed = residual + x
    return rms_norm(summed, weight, eps), summed


def activation(name: str):
    """The activation function a config names: torch's SiLU for the Llama family's "silu" (what
    transformers' ACT2FN maps it to), else transformers' own (whose module takes 0.7 s to import,
    a sixth of loading a cached model)."""
    if name == "silu":
        return torch.nn.functional.silu
    from transformers.activations import ACT2FN

    return ACT2FN[name]


def gated(gate_up: torch.Tensor, act, hidden_act: str, kernel: bool = False) -> torch.Tensor:
    """act(gate) * up of the fused gate/up projection's output [T, 2 * I] (gate first)."""
    if kernel and hidden_act == "silu":  # one kernel instead of two
        from ..kernels.activation import silu_mul
        return silu_mul(gate_up)
    gate, up = gate_up.chunk(2, dim=-1)
    return act(gate) * up


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kernel: bool = False) -> torch.Tensor:
    """x [T, heads, D]; cos/sin [T, 1, D] (rotate-half layout, as Hugging Face checkpoints use)."""
    if kernel:  # one fused kernel instead of five
        from ..kernels.norm_rope import rope
        return rope(x, cos, sin)
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


class DecoderLayer:
    def __init__(self, cfg: ModelConfig, weights: dict[str, torch.Tensor], sliding: bool):
        self.cfg = cfg
        self.sliding = sliding  # attends within cfg.sliding_window
        self.input_norm = weights["input_norm"]
        self.qkv = Linear(weights["qkv"], weights.get("qkv_bias"))
        self.q_norm = weights.get("q_norm")
        self.k_norm = weights.get("k_norm")
        self.o = Linear(weights["o"])
        self.post_norm = weights["post_norm"]
        self.gate_up = Linear(weights["gate_up"])
        self.down = Linear(weights["down"])
        self.act = activation(cfg.hidden_act)
        self.q_size = cfg.num_heads * cfg.head_dim
        self.kv_size = cfg.num_kv_heads * cfg.head_dim
        self.scale = cfg.head_dim ** -0.5

    def forward(self, hidden, residual, cos, sin, k_cache, v_cache, meta: AttentionMetadata, backend,
                kernels: bool = False):
        """hidden: the last layer's MLP output (layer 0: the embeddings); residual: the stream
        it adds to (layer 0: None). Returns this layer's (MLP output, residual stream): each
        add happens in the norm after it, one kernel with `kernels`."""
        cfg, eps = self.cfg, self.cfg.rms_norm_eps
        if residual is None:
            residual, x = hidden, rms_norm(hidden, self.input_norm, eps, kernels)
        else:
            x, residual = add_rms_norm(hidden, residual, self.input_norm, eps, kernels)
        qkv = self.qkv(x)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(-1, cfg.num_heads, cfg.head_dim)
        k = k.view(-1, cfg.num_kv_heads, cfg.head_dim)
        v = v.view(-1, cfg.num_kv_heads, cfg.head_dim)
        if self.q_norm is not None:
            q = rms_norm(q, self.q_norm, eps, kernels)
            k = rms_norm(k, self.k_norm, eps, kernels)
        q = apply_rope(q, cos, sin, kernels)
        k = apply_rope(k, cos, sin, kernels)
        backend.store(k, v, k_cache, v_cache, meta)
        attn = backend.attend(q, k_cache, v_cache, meta, self.scale, sliding=self.sliding)
        x, residual = add_rms_norm(self.o(attn.reshape(-1, self.q_size)), residual, self.post_norm, eps, kernels)
        return self.down(gated(self.gate_up(x), self.act, cfg.hidden_act, kernels)), residual


class DecoderModel:
    """The decoder. `forward` runs packed tokens of many sequences; `logits` projects the rows
    that need a next-token distribution."""

    def __init__(self, cfg: ModelConfig, weights: dict[str, torch.Tensor], inv_freq: torch.Tensor,
                 rope_scale: float):
        self.cfg = cfg
        self.embed = weights["embed"]
        self.norm = weights["norm"]
        self.lm_head = Linear(weights["lm_head"])
        self.layers = [
            DecoderLayer(cfg, {k.split(".", 2)[2]: v for k, v in weights.items() if k.startswith(f"layers.{i}.")},
                         sliding=cfg.sliding_window is not None and i not in cfg.full_attention_layers)
            for i in range(cfg.num_layers)
        ]
        self.inv_freq = inv_freq.to(self.embed.device)
        self.rope_scale = rope_scale
        # Norms, RoPE and the gate through the Triton kernels (kernels/norm_rope.py, activation.py).
        self.kernels = self.embed.is_cuda

    @property
    def dtype(self) -> torch.dtype:
        return self.embed.dtype

    @property
    def device(self) -> torch.device:
        return self.embed.device

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                pool: KVPool, backend) -> torch.Tensor:
        """input_ids, positions: [T]; returns the final hidden states [T, hidden_size]."""
        freqs = positions.float()[:, None] * self.inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)[:, None, :]
        cos = (emb.cos() * self.rope_scale).to(self.dtype)
        sin = (emb.sin() * self.rope_scale).to(self.dtype)
        backend.prepare(meta)
        hidden, residual = F.embedding(input_ids, self.embed), None
        for i, layer in enumerate(self.layers):
            hidden, residual = layer.forward(hidden, residual, cos, sin, pool.k[i], pool.v[i], meta, backend,
                                             self.kernels)
        return hidden if residual is None else residual + hidden  # (a model of no layers)

    @torch.inference_mode()
    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [N, hidden_size] -> float32 logits [N, vocab_size]."""
        return self.lm_head(rms_norm(hidden, self.norm, self.cfg.rms_norm_eps, self.kernels)).float()
