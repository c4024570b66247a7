"""A tiny Llama model and tokenizer built on this machine (no download).

Random weights make greedy output arbitrary but deterministic in float32, which is what
reuse-on vs reuse-off comparisons need. The tokenizer is a word-level vocabulary with a
whitespace pre-tokenizer and a space-joining decoder, so decode -> encode round-trips
exactly: a conversation that sends back its previous answers resends the same tokens.
"""

from __future__ import annotations

import json
import pathlib
import random
from dataclasses import asdict, dataclass

SPECIALS = ["<unk>", "<s>", "</s>", "<|user|>", "<|assistant|>", "<|system|>"]
# Whitespace-separated role markers keep the template word-level too.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for m in messages %}<|{{ m['role'] }}|> {{ m['content'] }} {% endfor %}"
    "{% if add_generation_prompt %}<|assistant|> {% endif %}"
)


@dataclass(frozen=True)
class TinyModelConfig:
    hidden_size: int = 512
    num_hidden_layers: int = 4
    num_attention_heads: int = 8
    num_key_value_heads: int = 4
    intermediate_size: int = 1024
    vocab_size: int = 4096
    # Agents' histories run to 64k-200k tokens: examples/local-long.yaml serves 131072
    # (its maxModelLen may not exceed this). The rotary table it sizes is 32 MiB in float32.
    max_position_embeddings: int = 131072
    init_std: float = 0.05  # wide enough that greedy output does not collapse to one token
    seed: int = 1234


def words(n: int, seed: int) -> list[str]:
    """n distinct lowercase pseudo-words (deterministic)."""
    rng = random.Random(seed)
    letters = "abcdefghijklmnopqrstuvwxyz"
    out: list[str] = []
    seen: set[str] = set()
    while len(out) < n:
        w = "".join(rng.choice(letters) for _ in range(rng.randint(2, 7)))
        if w not in seen:
            seen.add(w)
            out.append(w)
    return out


def build_tokenizer(cfg: TinyModelConfig):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(SPECIALS)}
    for w in words(cfg.vocab_size - len(SPECIALS), cfg.seed):
        vocab[w] = len(vocab)
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##", cleanup=False)  # joins with spaces
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>"
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


def build_model(path: str | pathlib.Path, cfg: TinyModelConfig | None = None,
                dtype: str = "bfloat16") -> pathlib.Path:
    """Write a loadable model folder (config, safetensors, tokenizer); idempotent."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = cfg or TinyModelConfig()
    path = pathlib.Path(path)
    stamp = path / "bidirkv-model.json"
    want = {"config": asdict(cfg), "dtype": dtype}
    if stamp.exists() and json.loads(stamp.read_text()) == want:
        return path
    path.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(cfg.seed)
    tokenizer = build_tokenizer(cfg)
    config = LlamaConfig(
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_hidden_layers,
        num_attention_heads=cfg.num_attention_heads,
        num_key_value_heads=cfg.num_key_value_heads,
        max_position_embeddings=cfg.max_position_embeddings,
        initializer_range=cfg.init_std,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        tie_word_embeddings=False,
        torch_dtype=dtype,
    )
    model = LlamaForCausalLM(config)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0.0, cfg.init_std)
    model.to(getattr(torch, dtype)).save_pretrained(path, safe_serialization=True)
    tokenizer.save_pretrained(path)
    stamp.write_text(json.dumps(want))
    return path


def random_text(n_words: int, seed: int) -> str:
    """User text of exactly n_words tokens of the tiny vocabulary."""
    vocab = words(TinyModelConfig().vocab_size - len(SPECIALS), TinyModelConfig().seed)
    rng = random.Random(seed)
    return " ".join(rng.choice(vocab) for _ in range(n_words))


if __name__ == "__main__":
    import sys

    print(build_model(sys.argv[1] if len(sys.argv) > 1 else "out/tiny-model"))
