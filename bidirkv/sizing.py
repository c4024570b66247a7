"""How many conversations a decode replica keeps at a context length (pure).

The replica's KV capacity x `kvTransfer.retentionWatermark`, over one history's KV: per
token 2 (K and V) x layers x KV heads x head dimension x the KV dtype's bytes, summed over
the tensor-parallel GPUs. The capacity is each GPU's memory x `--gpu-memory-utilization`
less the weights' share and `overhead_gib` (an estimate: once an engine ran, use the
"GPU KV cache size: N tokens" it logs). `bidir-kv sizing FILE --context N` prints it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

GIB = 1 << 30
DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2, "fp8": 1, "fp8_e4m3": 1,
               "fp8_e5m2": 1}


@dataclass(frozen=True)
class ModelShape:
    """What decides a model's KV per token and its weights' bytes."""

    layers: int
    kv_heads: int
    head_dim: int
    params_b: float  # billions of parameters (the weights' bytes at `dtype`)

    def kv_bytes_per_token(self, kv_dtype_bytes: int) -> int:
        return 2 * self.layers * self.kv_heads * self.head_dim * kv_dtype_bytes


# From each model's published config.json (num_hidden_layers, num_key_value_heads,
# head_dim) and parameter count: models whose config cannot be read here (no download).
KNOWN = {
    "Qwen/Qwen3-32B": ModelShape(64, 8, 128, 32.8),
    "Qwen/Qwen3-8B": ModelShape(36, 8, 128, 8.2),
    "meta-llama/Llama-3.1-8B-Instruct": ModelShape(32, 8, 128, 8.0),
    "meta-llama/Llama-3.1-70B-Instruct": ModelShape(80, 8, 128, 70.6),
}


def shape_of_config(config: dict[str, Any], params_b: float) -> ModelShape:
    """A model's shape from its Hugging Face config.json (`params_b`: its size, which the
    config does not state)."""
    try:
        layers = int(config["num_hidden_layers"])
        heads = int(config["num_attention_heads"])
        kv_heads = int(config.get("num_key_value_heads") or heads)
        head_dim = int(config.get("head_dim") or int(config["hidden_size"]) // heads)
    except (KeyError, TypeError, ValueError) as exc:
        raise ValueError(f"the model config lacks or mistypes {exc}: it needs "
                         "num_hidden_layers, num_attention_heads and hidden_size or "
                         "head_dim") from exc
    return ModelShape(layers, kv_heads, head_dim, params_b)


@dataclass(frozen=True)
class Hardware:
    gpus: int  # per decode replica (its tensor-parallel size)
    gpu_memory_gib: float = 140.0  # an H200 as vLLM sees it
    utilization: float = 0.9  # vLLM's --gpu-memory-utilization default
    overhead_gib: float = 6.0  # per GPU: activations, CUDA graphs, communication


@dataclass(frozen=True)
class Sizing:
    kv_bytes_per_token: int
    kv_capacity_tokens: int  # per decode replica
    retained_tokens: int  # the watermark's share of it
    rows: list[tuple[int, int, int]]  # (context, histories that fit, conversations kept)


def size(shape: ModelShape, hw: Hardware, dtype_bytes: int, kv_dtype_bytes: int,
         watermark: float, contexts: list[int]) -> Sizing:
    """Conversations one decode replica keeps at each context length."""
    per_token = shape.kv_bytes_per_token(kv_dtype_bytes)
    weights_per_gpu = shape.params_b * 1e9 * dtype_bytes / hw.gpus
    kv_per_gpu = hw.gpu_memory_gib * GIB * hw.utilization - weights_per_gpu \
        - hw.overhead_gib * GIB
    if kv_per_gpu <= 0:
        raise ValueError(
            f"nothing is left for KV: {hw.gpu_memory_gib} GiB x {hw.utilization} per GPU "
            f"holds less than the weights' share ({weights_per_gpu / GIB:.1f} GiB) and "
            f"the overhead ({hw.overhead_gib} GiB)")
    capacity = int(kv_per_gpu * hw.gpus // per_token)
    retained = int(capacity * watermark)
    rows = [(c, capacity // c, retained // c) for c in contexts]
    return Sizing(per_token, capacity, retained, rows)


def table(s: Sizing, watermark: float) -> str:
    """The sizing as a Markdown table, with the figures it rests on."""
    lines = [f"KV per token: {s.kv_bytes_per_token / 1024:.0f} KiB per replica; KV "
             f"capacity: {s.kv_capacity_tokens:,} tokens per decode replica; retained "
             f"conversations may pin {watermark:g} of it ({s.retained_tokens:,} tokens).",
             "",
             "| context (tokens) | KV of one history | histories that fit | conversations "
             "kept (retentionWatermark) |",
             "|---|---|---|---|"]
    for context, fit, kept in s.rows:
        gib = context * s.kv_bytes_per_token / GIB
        lines.append(f"| {context:,} | {gib:.1f} GiB | {fit:,} | {kept:,} |")
    return "\n".join(lines)


def load_config(path: str) -> dict[str, Any]:
    with open(path, encoding="utf-8") as fh:
        config = json.load(fh)
    if not isinstance(config, dict):
        raise ValueError(f"{path} is not a JSON object")
    return config


def dtype_bytes(name: str, default: int = 2) -> int:
    """Bytes of a dtype as the spec or vLLM names it (`auto`: the model's, bf16 mostly)."""
    if name in (None, "", "auto"):
        return default
    key = str(name).removeprefix("torch.")
    if key not in DTYPE_BYTES:
        raise ValueError(f"dtype {name!r} is not one of {', '.join(sorted(DTYPE_BYTES))}")
    return DTYPE_BYTES[key]


def contexts_ok(contexts: list[int]) -> list[int]:
    bad = [c for c in contexts if not (isinstance(c, int) and 0 < c < 1 << 40)]
    if bad:
        raise ValueError(f"--context {bad[0]!r}: a context is a positive number of tokens")
    return sorted(set(contexts)) or [32_768, 131_072]



# -- `bidir-kv sizing` ------------------------------------------------------------------
def add_arguments(p: Any) -> None:
    p.add_argument("-f", "--file", required=True,
                   help="a DisaggregatedInference YAML: its model, dtype, decode "
                   "tensorParallelSize and kvTransfer.retentionWatermark are read")
    p.add_argument("--context", type=int, action="append", default=[], metavar="TOKENS",
                   help="a history length to size for (repeat; default 32768 and 131072)")
    p.add_argument("--model-config", metavar="PATH",
                   help="the model's config.json (default: a known model's shape, "
                   f"one of {', '.join(KNOWN)})")
    p.add_argument("--params-b", type=float, metavar="B",
                   help="with --model-config: the model's parameters, in billions")
    p.add_argument("--gpu-memory-gib", type=float, default=Hardware.gpu_memory_gib,
                   help="memory of one GPU as vLLM sees it (default: an H200's 140)")
    p.add_argument("--gpu-memory-utilization", type=float, default=Hardware.utilization,
                   help="vLLM's --gpu-memory-utilization (default 0.9)")
    p.add_argument("--overhead-gib", type=float, default=Hardware.overhead_gib,
                   help="per GPU: activations, CUDA graphs, communication (an estimate)")
    p.add_argument("--kv-cache-dtype", default="auto",
                   help="vLLM's --kv-cache-dtype (default: the model's dtype)")


def run(args: Any) -> int:
    import sys

    import yaml

    from bidirkv.operator.api.spec import SpecError, parse_spec

    def fail(message: str) -> int:
        print(f"bidir-kv sizing: {message}", file=sys.stderr)
        return 2

    try:
        with open(args.file, encoding="utf-8") as fh:
            doc = yaml.safe_load(fh)
        spec = parse_spec((doc or {}).get("spec") or {})
        name = spec.model.name
        if args.model_config:
            if not args.params_b or args.params_b <= 0:
                return fail("--model-config needs --params-b, the model's parameters in "
                            "billions (the weights' share of GPU memory)")
            shape = shape_of_config(load_config(args.model_config), args.params_b)
        elif name in KNOWN:
            shape = KNOWN[name]
        else:
            return fail(f"model {name!r}: its shape is not known here; give its "
                        "config.json with --model-config and its size with --params-b")
        weights = dtype_bytes(str(spec.model.dtype))
        kv = dtype_bytes(args.kv_cache_dtype, default=weights)
        hw = Hardware(spec.decode.tensor_parallel_size, args.gpu_memory_gib,
                      args.gpu_memory_utilization, args.overhead_gib)
        watermark = spec.kv_transfer.retention_watermark
        s = size(shape, hw, weights, kv, watermark, contexts_ok(args.context))
    except (OSError, yaml.YAMLError, SpecError, ValueError) as exc:
        return fail(str(exc))
    print(f"{name}, decode TP{hw.gpus} x {hw.gpu_memory_gib:g} GiB at "
          f"{hw.utilization:g}, {hw.overhead_gib:g} GiB overhead a GPU (estimates: vLLM "
          "logs the real KV capacity as 'GPU KV cache size' when it starts)")
    print(table(s, watermark))
    limit = spec.model.max_model_len
    if limit is not None and any(c > limit for c, _, _ in s.rows):
        print(f"(contexts over model.maxModelLen, {limit:,}, are refused by the engines)")
    return 0
