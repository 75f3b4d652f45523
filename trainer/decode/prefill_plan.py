"""How the batch generator prefills a refill's prompts (`BatchGenerator._fill`): which prompts share a forward, from
which position, how wide. Pure: prompt lengths in, forwards out.

Two plans, by what the target's attention can compute (`StaticTarget.whole_prefill`):
- whole prompts (`whole_forwards`; full causal softmax attention through SDPA, with or without linear layers: Qwen3,
  Llama, Qwen3-MoE, the Qwen3.5 / Qwen3-Next hybrids): a forward takes whole prompts from position 0, so its
  attention is causal SDPA over the forward's own keys (flash attention on CUDA: no mask, no cache read) and it can be
  as wide as its longest prompt. Prompts go longest first; a forward takes the next one while its rows x width stay
  within PREFILL_TOKENS and the prompt is at most SPLIT_PADDING tokens shorter than the forward's width (a padding
  position costs a GEMM what a token does, a forward of its own costs a read of the weights and its launches). A
  prompt longer than PREFILL_TOKENS goes alone, in chunks.
- chunks (`chunked_forwards`; soft-capped scores, sinks, sliding windows: attention through a mask over the cache):
  the prompts together, at most PREFILL_CHUNK positions a forward (fewer where the attention scores of the rows
  would pass SCORE_BUDGET), each forward as wide as its rows' tails need (`chunk_width`); a prompt leaves the chunks
  once it has ended.
Padding past a shorter prompt's end writes slots its own decode rewrites before any query sees them.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import NamedTuple

SCORE_BUDGET = 2 ** 28  # attention score elements (rows x heads x chunk x slots) one masked prefill chunk may hold
PREFILL_CHUNK = 512  # the most positions of a row one masked prefill forward takes
PREFILL_ALIGN = 64  # a chunk's width: the tail it covers rounded up to this (below it, a power of two)
PREFILL_TOKENS = 8192  # the most positions (rows x width) of a whole-prompt forward
WHOLE_ALIGN = 8  # a whole-prompt forward's width: its longest prompt rounded up to this
SPLIT_PADDING = 256  # a prompt shorter than a whole-prompt forward's width by more starts the next forward


class Forward(NamedTuple):
    """One prefill forward: prompts `prompts` (indices into the refill's, ascending), positions start..start+width-1
    of each (a prompt shorter than that is padded)."""

    prompts: tuple[int, ...]
    start: int
    width: int


def chunk_width(tail: int, chunk: int) -> int:
    """The width of a prefill chunk whose longest row has `tail` tokens to go, at most `chunk`: the tail rounded up
    to PREFILL_ALIGN (below it, to a power of two, at least 16). Not a power of two above it: a 600-token prompt
    in 512-position chunks computes 512 + 128 positions, not 1,024."""
    if tail < PREFILL_ALIGN:
        return min(chunk, 1 << max(4, (tail - 1).bit_length()))
    return min(chunk, -(-tail // PREFILL_ALIGN) * PREFILL_ALIGN)


def chunked_forwards(lengths: Sequence[int], prompts: Sequence[int], heads: int,
                     span_of: Callable[[int], int]) -> list[Forward]:
    """The chunks plan (module docstring) for prompts `prompts` (indices into lengths, ascending); span_of(n): the
    cache slots a masked forward reading n slots reads."""
    longest = max(lengths[i] for i in prompts)
    chunk = min(PREFILL_CHUNK, 1 << max(4, (longest - 1).bit_length()))
    while chunk > 16 and len(prompts) * heads * chunk * span_of(longest) > SCORE_BUDGET:
        chunk //= 2
    out, a = [], 0
    while a < longest:
        sel = tuple(i for i in prompts if lengths[i] > a)
        width = chunk_width(max(lengths[i] for i in sel) - a, chunk)
        out.append(Forward(sel, a, width))
        a += width
    return out


def whole_width(longest: int) -> int:
    return -(-longest // WHOLE_ALIGN) * WHOLE_ALIGN


def whole_forwards(lengths: Sequence[int], heads: int, span_of: Callable[[int], int]) -> list[Forward]:
    """The whole-prompts plan (module docstring) for every prompt of `lengths`."""
    out: list[Forward] = []
    group: list[int] = []

    def close() -> None:
        if group:
            out.append(Forward(tuple(sorted(group)), 0, whole_width(lengths[group[0]])))
            group.clear()

    for i in sorted(range(len(lengths)), key=lambda j: -lengths[j]):  # stable: equal lengths in queue order
        if group:
            width = whole_width(lengths[group[0]])
            if (len(group) + 1) * width <= PREFILL_TOKENS and width - lengths[i] <= SPLIT_PADDING:
                group.append(i)
                continue
            close()
        if whole_width(lengths[i]) > PREFILL_TOKENS:
            out.extend(chunked_forwards(lengths, [i], heads, span_of))
        else:
            group.append(i)
    close()
    return out


def prefill_forwards(lengths: Sequence[int], whole: bool, heads: int, span_of: Callable[[int], int]) -> list[Forward]:
    """A refill's forwards: the whole-prompts plan where the target computes it (`whole`), else the chunks plan."""
    return whole_forwards(lengths, heads, span_of) if whole else \
        chunked_forwards(lengths, range(len(lengths)), heads, span_of)
