"""What a regenerate job will do, decided before torch: its settings, the prompts to answer and their keys. Pure.

A job answers each distinct conversation of the prompt files (`trainer.prompts`: through its last user turn) once
per sample (`continuations`, sampled when > 1). A prompt's key is a hash of the turns the target sees (the system
turn `--system` adds included), so a restarted job recognises the answers it already wrote whatever the files'
order; a conversation that occurs twice is answered once.
"""
from __future__ import annotations

import hashlib
import json
import math
from dataclasses import asdict, dataclass, field

from trainer.config import DTYPES, device_spec_ok
from trainer.errors import ConfigError
from trainer.prompts import PromptLine
from trainer.regen.rows import THINKING_MODES

ENGINES = ("static", "hf")


@dataclass(frozen=True)
class SamplingSettings:
    """The fields of trainer.decode.generate.Sampling, held here without torch (pre-torch validation)."""

    max_new_tokens: int = 512
    temperature: float = 0.0  # 0 = greedy
    top_p: float = 1.0
    seed: int = 0


@dataclass(frozen=True)
class RegenSettings:
    sampling: SamplingSettings = field(default_factory=SamplingSettings)
    continuations: int = 1  # answers per prompt
    chat_template_kwargs: dict = field(default_factory=dict)  # passed to apply_chat_template (enable_thinking, ...)
    system: str | None = None  # a system turn for conversations that have none
    engine: str = "static"
    dtype: str = "auto"
    device: str = "auto"
    batch: int = 64  # rows generated together
    limit: int = 0  # 0 = every prompt; else the first N distinct prompts
    max_bad_fraction: float = 0.01
    thinking: str = "keep"  # the reasoning segment in the training rows: keep | drop (trainer.regen.rows)
    drop_truncated: bool = False  # answers that reach max_new_tokens leave the training data
    memory_gib: float = 0.0  # the memory budget the sizing checks against (0: the GPU's free memory; none on CPU)
    target_fp8: bool = False  # the target's decoder linears in FP8 (trainer.model.fp8_target), as an FP8 server runs

    def output_settings(self) -> dict:
        """What decides the rows: a restarted job must run with the same (checked against the sidecar). The row
        options appear only when not at their defaults, so an OUT written without them resumes at the defaults."""
        out = {"sampling": asdict(self.sampling), "continuations": self.continuations,
               "chat_template_kwargs": self.chat_template_kwargs, "system": self.system, "dtype": self.dtype}
        if self.thinking != "keep":
            out["thinking"] = self.thinking
        if self.drop_truncated:
            out["drop_truncated"] = True
        if self.target_fp8:  # the FP8 target's answers, not the bf16 target's
            out["target_fp8"] = True
        return out


def resolved_dtype(dtype: str, device_type: str) -> str:
    """--dtype as the target runs: auto is bfloat16 on CUDA, float32 elsewhere. Pure."""
    if dtype != "auto":
        return dtype
    return "bfloat16" if device_type == "cuda" else "float32"


def check_settings(s: RegenSettings) -> None:
    """One ConfigError (exit 2) for the first bad setting."""
    p = s.sampling
    rules = [
        (p.max_new_tokens >= 1, "--max-new must be >= 1"),
        (math.isfinite(p.temperature) and p.temperature >= 0.0,
         f"--temperature must be a finite number >= 0 (0 = greedy), got {p.temperature}"),
        (0.0 < p.top_p <= 1.0, "--top-p must be in (0, 1]"),
        (0 <= p.seed < 2 ** 64, f"--seed must be in [0, 2**64) (torch's seed range), got {p.seed}"),
        (s.continuations >= 1, "--continuations must be >= 1"),
        (s.continuations == 1 or p.temperature > 0.0,
         f"--continuations {s.continuations} needs --temperature > 0: greedy answers of one prompt are all equal"),
        (s.batch >= 1, "--batch must be >= 1"),
        (s.limit >= 0, "--limit must be >= 0 (0 = every prompt)"),
        (0.0 <= s.max_bad_fraction <= 1.0, "--max-bad-fraction must be in [0, 1]"),
        (s.thinking in THINKING_MODES, f"--thinking must be one of {', '.join(THINKING_MODES)}"),
        (math.isfinite(s.memory_gib) and s.memory_gib >= 0, "--memory-gib must be a finite number >= 0"),
        (s.engine in ENGINES, f"--engine must be one of {', '.join(ENGINES)}"),
        (s.dtype in DTYPES, f"--dtype must be one of {', '.join(DTYPES)}"),
        # the row-wise scaled FP8 products return bf16 (trainer.model.fp8.rowwise_matmul_error)
        (not (s.target_fp8 and s.dtype == "float32"),
         "--target-fp8 runs the target in bfloat16 (its FP8 products' output): leave --dtype at auto or bfloat16"),
        (device_spec_ok(s.device), f"--device must be auto, cpu, cuda or cuda:N, got {s.device!r}"),
    ]
    for ok, message in rules:
        if not ok:
            raise ConfigError(message)


def template_kwargs(raw: str | None, enable_thinking: str | None) -> dict:
    """--chat-template-kwargs JSON and --enable-thinking on|off -> the keyword arguments of apply_chat_template."""
    kwargs: dict = {}
    if raw:
        try:
            kwargs = json.loads(raw)
        except json.JSONDecodeError as e:
            raise ConfigError(f"--chat-template-kwargs is not JSON: {e}",
                              hint="""e.g. --chat-template-kwargs '{"enable_thinking": false}'""") from None
        if not isinstance(kwargs, dict):
            raise ConfigError("--chat-template-kwargs must be a JSON object")
    reserved = sorted(set(kwargs) & {"tokenize", "add_generation_prompt", "conversation", "messages"})
    if reserved:
        raise ConfigError(f"--chat-template-kwargs sets {reserved}, which regenerate itself decides")
    if enable_thinking is not None:
        if "enable_thinking" in kwargs and kwargs["enable_thinking"] != (enable_thinking == "on"):
            raise ConfigError("--enable-thinking and --chat-template-kwargs disagree on enable_thinking")
        kwargs["enable_thinking"] = enable_thinking == "on"
    return kwargs


@dataclass(frozen=True)
class Prompt:
    key: str
    turns: tuple[dict, ...]
    path: str  # where it first occurs
    line_no: int

    @property
    def source(self) -> str:
        return f"{self.path}:{self.line_no}"


def with_system(turns: tuple[dict, ...], system: str | None) -> tuple[dict, ...]:
    if system is None or any(t["role"] == "system" for t in turns):
        return turns
    return ({"role": "system", "content": system},) + turns


def prompt_key(turns: tuple[dict, ...]) -> str:
    canonical = json.dumps([[t["role"], t["content"]] for t in turns], ensure_ascii=False, separators=(",", ":"))
    return hashlib.sha256(canonical.encode("utf-8")).hexdigest()[:24]


def distinct_prompts(lines: list[PromptLine], system: str | None, limit: int = 0) -> tuple[list[Prompt], int]:
    """Good prompt lines -> the distinct prompts in file order (the first `limit` of them when > 0), and how many
    lines repeated an earlier prompt."""
    seen: set[str] = set()
    out: list[Prompt] = []
    repeats = 0
    for line in lines:
        turns = with_system(line.turns, system)
        key = prompt_key(turns)
        if key in seen:
            repeats += 1
            continue
        seen.add(key)
        out.append(Prompt(key, turns, line.path, line.line_no))
        if limit and len(out) == limit:
            break
    return out, repeats


def stream_of(key: str, sample: int) -> int:
    """The sampling noise stream of one (prompt, sample), in 0..2^31-1: the static engine draws a prompt's samples
    from it, so a resumed job (other batches) samples what the first run would have."""
    return int(hashlib.sha256(f"{key}:{sample}".encode()).hexdigest()[:8], 16) & 0x7FFFFFFF


def pending(prompts: list[Prompt], continuations: int, answered: frozenset[tuple[str, int]]) \
        -> list[tuple[Prompt, int]]:
    """(prompt, sample) pairs still to answer (`answered`: those in OUT or left out of it)."""
    return [(p, i) for p in prompts for i in range(continuations) if (p.key, i) not in answered]
