"""One Gated DeltaNet layer of a hybrid target (Qwen3.5, Qwen3.6, Qwen3-Next; dense and MoE) decoding over static
state buffers: per row, the convolution's last K-1 inputs and the recurrent state, allocated once and never
reallocated.

Written against the HF layer's own submodules and weights (projections, conv1d, A_log, dt_bias, gated norm,
out_proj) and the training target's math (`trainer.model.linear_attention`: the projections, the convolution, the
gates, HF's chunked rule given a start state), so a decode layer and a training layer differ in their buffers only.

A speculative verify needs no second forward. `forward(x)` over a block of L tokens reads the committed state and
keeps, per row, what rebuilds the state after any prefix of the block: the convolution's input window and the
block's rule terms (`BlockTerms`: keys, corrected values, decays; O(L (dk + dv)) per head, not L states).
`commit(accepted)` then sets each row's state to the one after its accepted prefix, on the device. A decode step
is one token through the rule's recurrent form (on CUDA with fla, `recurrent_kernel.py`'s fused kernel, which reads each
row's state once and writes it back in place), its convolution, conv-state shift and gates one `conv_step.py` kernel
unless switched off (the kernel "conv", `decode/switches.py`); `prefill` convolves the whole chunk (one
`conv_prefill.py` kernel under the same switch), runs the rule in blocks of CHUNK tokens (or fla's chunked kernel on
CUDA) and commits each row's valid prefix, so a right-padded prompt chunk leaves the padding out of the state.

Every method is free of host syncs and value-dependent shapes: the counts are device tensors, the block length a
Python int fixed per captured graph.

Called like the attention layer (`layer(h, step, kind)`), a `GatedDeltaNetDecode` is the stack's `linear` mixer
(`stack.MIXERS`): what the forward asks of it arrives as the step's `LinearCall` --
    prefill  from position 0 the state is zeroed first (a new sequence); row r takes its first valid[r] tokens
    step     a decode step: every token enters the state
    verify   a speculative verify: `forward` (the state kept; `commit` follows)
and in a padded batch a padding token enters as zeros (HF's `apply_mask_to_padding_states`), which leaves the zero
state of a new sequence zero.

Shape legend: R rows, L tokens, D hidden, C conv channels (2 * key dim + value dim), K conv taps, Hv value heads,
dk / dv head dims, B the longest block `forward` keeps.
"""
from __future__ import annotations

from typing import NamedTuple

import torch
from torch import nn

from trainer.decode import conv_prefill, conv_step, switches
from trainer.decode.gated_norm import GatedRMSNorm
from trainer.decode.recurrent_kernel import gated_delta_step_, usable_for
from trainer.model.linear_attention import (
    CHUNK, BlockTerms, PackedGatedDeltaNet, causal_conv1d_window, fla_gated_delta_rule_from, gated_delta_block,
    gated_delta_step, gated_output, gates, project, split_heads, state_after,
)

KERNELS = ("torch", "fla")
PREFILL, STEP, VERIFY = "prefill", "step", "verify"


class LinearCall(NamedTuple):
    """What every Gated DeltaNet layer of one forward is asked (the stack builds it once per forward)."""

    mode: str  # PREFILL | STEP | VERIFY (a Python str: fixed per captured graph)
    fresh: torch.Tensor  # 0-dim bool: the forward starts at position 0, a new sequence
    valid: torch.Tensor | None  # [R] long: the tokens a prefill takes into the state (None: all of them)
    real: torch.Tensor | None  # [R, L] bool: a padded batch's real tokens (None: unpadded rows)
    rows: torch.Tensor | None = None  # a prefill of these cache rows only ([R'] long; `fresh` then [R'] bool)


class GatedDeltaNetDecode:
    """The static decode form of HF Gated DeltaNet layer `inner` for `rows` rows (the training target's
    `PackedGatedDeltaNet` is looked through to the HF module it wraps).

    Buffers: `conv` [R, C, K-1] in the conv weight's dtype (HF keeps its conv state in the model dtype) and
    `state` [R, Hv, dk, dv] fp32 (HF's and fla's recurrent state), both zero at construction; the pending block of
    the last `forward` (at most `block` tokens). kernel: "fla" runs `prefill` through fla's chunked kernel (CUDA,
    fla installed), "torch" through `gated_delta_block` per CHUNK tokens; `forward` (and a step of several tokens)
    always runs `gated_delta_block`. fused (default: kernel == "fla"): a one-token step through
    `recurrent_kernel.gated_delta_step_`, the state updated in place, else `gated_delta_step` and a copy back.
    conv_kernel (default: unless the kernel "conv" is switched off, `switches.py`): a one-token step's convolution,
    SiLU, conv-state shift and gates through `conv_step.conv_gates_step`, and a prefill's convolution and SiLU through
    `conv_prefill.conv_silu`, where each is usable, else the torch ops."""

    def __init__(self, inner: nn.Module, rows: int, block: int, kernel: str = "torch",
                 fused: bool | None = None, conv_kernel: bool | None = None) -> None:
        if kernel not in KERNELS:
            raise ValueError(f"kernel must be one of {KERNELS}, got {kernel!r}")
        if block < 1:
            raise ValueError(f"block must be at least 1, got {block}")
        if isinstance(inner, PackedGatedDeltaNet):
            inner = inner.inner
        self.inner, self.rows, self.block, self.kernel = inner, rows, block, kernel
        weight = inner.conv1d.weight  # [C, 1, K]
        channels, taps = weight.shape[0], weight.shape[-1]
        self.taps = taps
        dev, dtype = weight.device, weight.dtype
        heads, dk, dv = inner.num_v_heads, inner.head_k_dim, inner.head_v_dim
        self.conv = torch.zeros(rows, channels, taps - 1, dtype=dtype, device=dev)
        self.state = torch.zeros(rows, heads, dk, dv, dtype=torch.float32, device=dev)
        # the last forward's block: the conv input window (the committed K-1 inputs, then the block's) and its terms
        self.window = torch.zeros(rows, taps - 1 + block, channels, dtype=dtype, device=dev)
        self.terms = BlockTerms(k=torch.zeros(rows, heads, block, dk, device=dev),
                                v_new=torch.zeros(rows, heads, block, dv, device=dev),
                                cum=torch.zeros(rows, heads, block, device=dev))
        self.pending = 0  # the last forward's L (a Python int: fixed per captured graph)
        self.gated_norm = GatedRMSNorm(inner.norm)  # one kernel where it runs (gated_norm.py), else HF's module
        self.joined = None  # the input projections as one GEMM (decode/fused.py), or None: each its own
        # fused: a one-token step through recurrent_kernel.py, the state updated in place (default: with fla's kernel)
        self.fused = kernel == "fla" if fused is None else fused
        if self.fused and not usable_for(self.state):
            raise ValueError(f"the fused step needs Triton on CUDA (or the interpreter on CPU), not {dev}")
        self.conv_kernel = switches.on("conv") if conv_kernel is None else conv_kernel

    # ------------------------------------------------------------ the block computation

    def _block(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, BlockTerms]:
        """x [R, L, D] after the committed state -> (out [R, L, D], window [R, K-1+L, C], terms). Changes nothing."""
        m = self.inner
        qkv, z, b, a = project(m, x, self.joined)
        window, mixed = self._convolve(qkv)
        q, k, v = split_heads(m, mixed)
        g, beta = gates(m, a, b)
        core, terms = gated_delta_block(q, k, v, g, beta, self.state)
        return gated_output(m, core, z, self.gated_norm), window, terms

    def _convolve(self, qkv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """qkv [R, L, C] -> (the window: committed inputs then qkv [R, K-1+L, C]; the causal conv + SiLU [R, L, C])."""
        window = torch.cat([self.conv.transpose(1, 2).to(qkv.dtype), qkv], dim=1)
        return window, causal_conv1d_window(window, self.inner.conv1d.weight.squeeze(1))

    def _conv_gates(self, qkv: torch.Tensor, a: torch.Tensor, b: torch.Tensor
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """One token a row: qkv [R, 1, C], a, b [R, 1, Hv] -> (the causal conv + SiLU [R, 1, C], g, beta [R, 1, Hv]),
        the conv state shifted by qkv. One kernel where on and usable (`conv_step.py`), else the torch ops."""
        m = self.inner
        args = (qkv, self.conv, m.conv1d.weight.squeeze(1), a, b, m.A_log, m.dt_bias)
        if self.conv_kernel and conv_step.usable(*args):
            return conv_step.conv_gates_step(*args)
        window, mixed = self._convolve(qkv)
        self.conv.copy_(window[:, 1:].transpose(1, 2))
        return (mixed, *gates(m, a, b))

    def _advance(self, window: torch.Tensor, terms: BlockTerms, n: torch.Tensor) -> None:
        """Set each row's buffers to those after the first n[r] tokens of the block (`window`, `terms`)."""
        self.conv.copy_(conv_prefill.state_after(self.conv, window[:, self.taps - 1:], n))  # window: state, block
        self.state.copy_(state_after(self.state, terms, n))

    # ------------------------------------------------------------ the stack's mixer

    def __call__(self, h: torch.Tensor, step, kind: str | None = None) -> torch.Tensor:
        """h [R, L, D] (the normed input) -> the layer's output [R, L, D], as `step.linear` (a `LinearCall`) asks.
        kind: unused (the attention layer's argument)."""
        call: LinearCall = step.linear
        if call.real is not None:
            h = h * call.real[..., None].to(h.dtype)
        if call.mode == VERIFY:
            return self.forward(h)
        if call.mode == STEP and call.rows is None:
            return self.step(h)
        if call.rows is not None:
            return self._on_rows(h, call)
        self.reset(call.fresh.expand(h.shape[0]))
        return self.prefill(h, call.valid)

    def _on_rows(self, h: torch.Tensor, call: LinearCall) -> torch.Tensor:
        """A step or a prefill chunk of cache rows call.rows only (the refilling batch generator: a compacted step,
        a refill): their conv and recurrent states gathered (a prefill's zeroed where the chunk starts a sequence),
        advanced by each row's (valid) tokens and written back; the other rows' states untouched."""
        conv, state, rows, fresh = self.conv, self.state, call.rows, call.fresh
        self.conv, self.state = conv.index_select(0, rows), state.index_select(0, rows)
        if call.mode != STEP:
            self.conv.masked_fill_(fresh.view(-1, 1, 1), 0)
            self.state.masked_fill_(fresh.view(-1, 1, 1, 1), 0)
        try:
            out = self.step(h) if call.mode == STEP else self.prefill(h, call.valid)
            conv.index_copy_(0, rows, self.conv)
            state.index_copy_(0, rows, self.state)
        finally:
            self.conv, self.state = conv, state
        return out

    # ------------------------------------------------------------ the decode API

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """A block x [R, L, D] (L <= block) from the committed state -> the layer's output [R, L, D]. The state is not
        changed: the block is kept until `commit` (a later forward replaces it)."""
        length = x.shape[1]
        if length > self.block:
            raise ValueError(f"a block of {length} tokens is longer than this layer keeps ({self.block})")
        out, window, terms = self._block(x)
        self.window[:, :self.taps - 1 + length].copy_(window)
        for mine, new in ((self.terms.k, terms.k), (self.terms.v_new, terms.v_new), (self.terms.cum, terms.cum)):
            mine[:, :, :length].copy_(new)
        self.pending = length
        return out

    def commit(self, accepted: torch.Tensor) -> None:
        """accepted [R] long (device): how many of the last forward's L tokens row r keeps, 0..L (a speculative round
        keeps a + 1: the anchor and its a accepted drafts; 0 leaves the row as it was). Each row's conv and recurrent
        state become those after its kept prefix, computed from the kept block on the device."""
        length = self.pending
        n = accepted.clamp(0, length)
        terms = BlockTerms(*(t[:, :, :length] for t in (self.terms.k, self.terms.v_new, self.terms.cum)))
        self._advance(self.window[:, :self.taps - 1 + length], terms, n)

    def step(self, x: torch.Tensor) -> torch.Tensor:
        """A decode step: x [R, L, D] (L small, usually 1) taken whole into every row's state -> out [R, L, D]. One
        token runs the rule's recurrent form (`gated_delta_step`: fewer kernels than a block of one and its commit)."""
        if x.shape[1] > 1:
            out, window, terms = self._block(x)
            self._advance(window, terms, torch.full((self.rows,), x.shape[1], dtype=torch.long, device=x.device))
            return out
        m = self.inner
        qkv, z, b, a = project(m, x, self.joined)
        mixed, g, beta = self._conv_gates(qkv, a, b)
        q, k, v = split_heads(m, mixed)
        if self.fused:
            core = gated_delta_step_(q, k, v, g, beta, self.state)
        else:
            core, state = gated_delta_step(q, k, v, g, beta, self.state)
            self.state.copy_(state)
        return gated_output(m, core, z, self.gated_norm)

    def prefill(self, x: torch.Tensor, valid: torch.Tensor | None = None) -> torch.Tensor:
        """x [R, L, D] (any L) from the committed state -> out [R, L, D]; row r takes its first valid[r] tokens
        (valid [R] long, device; default L) into its state, so a right-padded chunk leaves its padding out and a row
        with valid 0 is unchanged. Outputs past a row's valid tokens are not meaningful. The convolution runs over
        the whole chunk (`_prefill_conv`); the rule through fla's chunked kernel (kernel "fla": the tokens past
        valid[r] get g = 0 and beta = 0, no decay and no write, so its final state is the state after the valid
        ones) or per CHUNK tokens (`gated_delta_block`, each row's state advanced by its valid tokens of the chunk)."""
        rows, length, _ = x.shape
        if valid is None:
            valid = torch.full((rows,), length, dtype=torch.long, device=x.device)
        m = self.inner
        qkv, z, b, a = project(m, x, self.joined)
        q, k, v = split_heads(m, self._prefill_conv(qkv, valid))
        g, beta = gates(m, a, b)
        if self.kernel == "fla":
            past = (torch.arange(length, device=x.device)[None] >= valid[:, None])[..., None]  # [R, L, 1]
            g, beta = g.masked_fill(past, 0.0), beta.masked_fill(past, 0.0)
            core, final = fla_gated_delta_rule_from(q, k, v, g.float(), beta.to(q.dtype), self.state)
            self.state.copy_(final)
        else:
            cores = []
            for lo in range(0, length, CHUNK):
                hi = min(lo + CHUNK, length)
                core, terms = gated_delta_block(*(t[:, lo:hi] for t in (q, k, v, g, beta)), self.state)
                self.state.copy_(state_after(self.state, terms, (valid - lo).clamp(0, hi - lo)))
                cores.append(core)
            core = torch.cat(cores, dim=1)
        return gated_output(m, core, z, self.gated_norm)

    def _prefill_conv(self, qkv: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
        """qkv [R, L, C] after the committed conv state -> the causal conv + SiLU [R, L, C]; each row's conv state
        set to its last K-1 inputs after valid[r] tokens. One kernel where on and usable (`conv_prefill.py`), else
        the torch ops over the window."""
        weight = self.inner.conv1d.weight.squeeze(1)
        if self.conv_kernel and conv_prefill.usable(qkv, self.conv, weight):
            mixed = conv_prefill.conv_silu(qkv, self.conv, weight)
        else:
            _, mixed = self._convolve(qkv)
        self.conv.copy_(conv_prefill.state_after(self.conv, qkv, valid))
        return mixed

    def reset(self, rows: torch.Tensor) -> None:
        """rows [R] bool (device): zero those rows' conv and recurrent state (a new sequence starts there, as a
        document starts from zero in training)."""
        self.conv.masked_fill_(rows.view(-1, 1, 1), 0)
        self.state.masked_fill_(rows.view(-1, 1, 1, 1), 0)


def decode_layers(model: nn.Module, rows: int, block: int, kernel: str = "torch") -> dict[int, GatedDeltaNetDecode]:
    """layer index -> its decode layer, for every Gated DeltaNet layer of HF causal LM `model`."""
    return {i: GatedDeltaNetDecode(layer.linear_attn, rows, block, kernel)
            for i, layer in enumerate(model.model.layers) if hasattr(layer, "linear_attn")}


def kernel_for(device: torch.device) -> str:
    """fla on CUDA where it imports, else torch (the training target's rule)."""
    from trainer.model.linear_attention import fla_available

    return "fla" if device.type == "cuda" and fla_available() else "torch"
