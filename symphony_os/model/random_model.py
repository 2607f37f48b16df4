"""Random-weight Hugging Face model directories, for tests and benchmarks: a real transformers
model (any Llama-family type) saved with safetensors, plus a real fast tokenizer over the words
"w0".."wN" so every id detokenizes."""
from __future__ import annotations

from pathlib import Path

import torch


def word_tokenizer(vocab_size: int):
    """A word-level tokenizer: <unk>=0, <s>=1, </s>=2, then "w3".."w{vocab_size-1}"."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    vocab.update({f"w{i}": i for i in range(3, vocab_size)})
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>")


def build_random_model(directory: Path, model_type: str = "llama", seed: int = 0, init_std: float | None = None,
                       dtype: torch.dtype = torch.float32, **config) -> Path:
    """Save a random `model_type` model with `config` (transformers config fields) and a word
    tokenizer into `directory`. `init_std` redraws every weight from N(0, init_std)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    directory = Path(directory)
    hf_config = AutoConfig.for_model(model_type, bos_token_id=1, eos_token_id=2, **config)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(hf_config, dtype=dtype)
    if init_std is not None:
        with torch.no_grad():
            for param in model.parameters():
                param.normal_(0, init_std)
    model.save_pretrained(directory)
    word_tokenizer(hf_config.vocab_size).save_pretrained(directory)
    return directory
