"""Will a regenerate job fit in memory? An estimate from config.json and the weight files' headers, made before
any weight loads (the tokenizer has run: the longest prompt is known). No torch.

  weights    every tensor of the safetensors headers (each file's first bytes; nothing else is read) at the job's
             dtype; an MXFP4 checkpoint's `*_blocks` count two values a byte and its `*_scales` nothing (they are
             dequantized on load); a `pytorch_model.bin` counts its size on disk
  per row    the cache: slots (the longest prompt + --max-new, rounded as the engine allocates) x K and V x KV heads
             x head dim for each softmax-attention layer, at the dtype; a sliding-window layer counts the static
             engine's ring, window + 2 slots (window + block of 1 + the trash slot: trainer/decode/layers/ring.py),
             where that is fewer; for each Gated DeltaNet layer its convolution state (channels x kernel, at the
             dtype) and recurrent state (value heads x key dim x value dim, fp32); a token step's logits work
             (LOGIT_BUFFERS fp32 vectors of the vocabulary); the prefill's activations of one row's prompt (HF's
             prefill runs the whole batch at once): prompt tokens x (4 x hidden + 3 x MLP width) at the dtype
  fixed      WORKSPACE_BYTES: a prefill chunk's attention scores (trainer.decode.prefill_plan.SCORE_BUDGET fp32
             elements, 1 GiB) and the allocator's slack
The budget is `--memory-gib`, else the GPU's free memory, of which USABLE is planned; on CPU without
`--memory-gib` nothing is checked. A job that does not fit is one ConfigError (exit 2) naming the `--batch` that
does.
"""
from __future__ import annotations

import json
import math
import struct
from dataclasses import dataclass
from pathlib import Path

from trainer.errors import ConfigError
from trainer.regen.plan import resolved_dtype
from trainer.targetdir import GATED_DELTANET_FAMILIES, LINEAR_LAYER_TYPE, text_config, weight_files

GIB = 2 ** 30
WORKSPACE_BYTES = 2 * GIB
LOGIT_BUFFERS = 4  # logits, Gumbel noise, the top-p sort and its softmax
WINDOW_EVERY_LAYER = ("mistral", "mixtral")  # families whose config has one window for every layer, no layer_types
SLIDING_LAYER_TYPE = "sliding_attention"
USABLE = 0.92  # of the budget: the allocator's fragmentation and what other processes take meanwhile
DTYPE_BYTES = {"F64": 8, "F32": 4, "I32": 4, "U32": 4, "I64": 8, "U64": 8, "F16": 2, "BF16": 2, "I16": 2, "U16": 2,
               "I8": 1, "U8": 1, "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1}


def dtype_bytes(dtype: str, device_type: str) -> int:
    """The job's --dtype as bytes per element (auto: bf16 on CUDA, fp32 on CPU: plan.resolved_dtype)."""
    return {"float32": 4, "bfloat16": 2, "float16": 2}[resolved_dtype(dtype, device_type)]


def safetensors_elements(path: Path) -> int:
    """Values in one safetensors file as they load (module docstring), from its header alone."""
    with open(path, "rb") as f:
        (size,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(size))
    total = 0
    for name, info in header.items():
        if name == "__metadata__":
            continue
        n = math.prod(info["shape"])
        if name.endswith("_scales") and info["dtype"] == "U8":
            continue
        total += 2 * n if name.endswith("_blocks") and info["dtype"] == "U8" else n
    return total


def weight_bytes(target: str | Path, dtype_size: int) -> int:
    """The target's weights at `dtype_size` bytes a value, from its files' headers (module docstring)."""
    total = 0
    for file in weight_files(Path(target)):
        total += safetensors_elements(file) * dtype_size if file.suffix == ".safetensors" else file.stat().st_size
    return total


def layer_types(cfg: dict) -> list[str]:
    """config.json's layer_types; where it has none, a Gated DeltaNet family's every `full_attention_interval`-th
    layer full attention and the rest linear (transformers' default), a Mistral-style config with a window every
    layer sliding (model/target.attention_kinds' rule), any other family all full attention (a sliding layer then
    counts every slot)."""
    n = cfg["num_hidden_layers"]
    if cfg.get("layer_types"):
        return list(cfg["layer_types"])[:n]
    if cfg.get("model_type") in GATED_DELTANET_FAMILIES:
        every = cfg.get("full_attention_interval") or 4
        return ["full_attention" if (i + 1) % every == 0 else LINEAR_LAYER_TYPE for i in range(n)]
    if cfg.get("model_type") in WINDOW_EVERY_LAYER and cfg.get("sliding_window"):
        return [SLIDING_LAYER_TYPE] * n
    return ["full_attention"] * n


def cache_slots(types: list[str], window: int | None, slots: int, block: int = 1) -> int:
    """Slots of all softmax-attention layers together: `slots` each, a sliding layer's ring of window + block + 1
    where that is fewer (trainer/decode/layers/ring.py's `ring_size`)."""
    ring = window + block + 1 if isinstance(window, int) and window > 0 else slots
    return sum(min(ring, slots) if t == SLIDING_LAYER_TYPE else slots for t in types if t != LINEAR_LAYER_TYPE)


def row_bytes(config: dict, slots: int, prompt_tokens: int, dtype_size: int) -> dict[str, int]:
    """One row's memory by part (module docstring): cache, linear_states, logits, prefill."""
    cfg = text_config(config)
    hidden, heads = cfg["hidden_size"], cfg["num_attention_heads"]
    kv = cfg.get("num_key_value_heads") or heads
    head_dim = cfg.get("head_dim") or hidden // heads
    types = layer_types(cfg)
    softmax = sum(t != LINEAR_LAYER_TYPE for t in types)
    linear = len(types) - softmax
    states = 0
    if linear:
        hk, hv = cfg["linear_num_key_heads"], cfg["linear_num_value_heads"]
        dk, dv = cfg["linear_key_head_dim"], cfg["linear_value_head_dim"]
        conv = (2 * hk * dk + hv * dv) * cfg.get("linear_conv_kernel_dim", 4) * dtype_size
        states = linear * (conv + hv * dk * dv * 4)
    width = cfg.get("intermediate_size") or (cfg.get("moe_intermediate_size", 0) * cfg.get("num_experts_per_tok", 1))
    cache = 2 * cache_slots(types, cfg.get("sliding_window"), slots) * kv * head_dim * dtype_size
    return {"cache": cache, "linear_states": states,
            "logits": LOGIT_BUFFERS * cfg["vocab_size"] * 4,
            "prefill": prompt_tokens * (4 * hidden + 3 * width) * dtype_size}


@dataclass(frozen=True)
class Estimate:
    weights: int
    per_row: dict  # row_bytes
    fixed: int = WORKSPACE_BYTES

    @property
    def row(self) -> int:
        return sum(self.per_row.values())

    def total(self, rows: int) -> int:
        return self.weights + self.fixed + rows * self.row

    def rows_within(self, budget: int) -> int:
        """The most rows whose total is within USABLE of `budget` (0: not even one)."""
        room = int(budget * USABLE) - self.weights - self.fixed
        return max(0, room // self.row) if self.row else 0


def estimate(config: dict, weights: int, slots: int, prompt_tokens: int, dtype_size: int) -> Estimate:
    return Estimate(weights=weights, per_row=row_bytes(config, slots, prompt_tokens, dtype_size))


def _gib(n: float) -> str:
    return f"{n / GIB:.1f} GiB"


def check_fits(est: Estimate, rows: int, budget: int, where: str, slots: int) -> None:
    """One ConfigError (exit 2) when `rows` rows do not fit in USABLE of `budget`, naming the --batch that does."""
    if est.total(rows) <= budget * USABLE:
        return
    fits = est.rows_within(budget)
    need = (f"{rows} rows need about {_gib(est.total(rows))} (weights {_gib(est.weights)} + {rows} x "
            f"{est.row / 2 ** 20:.0f} MiB a row for {slots} cache slots + {_gib(est.fixed)} workspace) and {where} "
            f"has {_gib(budget)}")
    if fits:
        raise ConfigError(f"--batch {rows} does not fit: {need}; --batch {fits} fits",
                          hint=f"pass --batch {fits}, or a smaller --max-new")
    raise ConfigError(f"not even --batch 1 fits: {need}",
                      hint="pass a smaller --max-new, shorter prompts, or run on a device with more memory")
