"""`flex` attention backend for the drafter's block attention, with a static, in-place-updatable BlockMask.

Layout (one row of the batch; S context positions, N anchors, block size B, Q = N*B queries, KV = S + N*B keys):
    keys    = [ctx features 0..S-1 | block 0 tokens | block 1 tokens | ... | block N-1 tokens]
    queries = [block 0 tokens | ... | block N-1 tokens]
Query block j sees the context keys in [ctx_lo[j], anchor[j]) -- strictly before its anchor, and not before the start
of the anchor's document (ctx_lo, 0 when rows are not packed) -- plus every token of its own block (bidirectional).
A block with valid[j] False sees only its own block (so no attention row is empty; the loss gives it weight 0).
With a sliding window W (the drafter's sliding layers), the query at block offset k also needs kv >= anchor + k -
(W - 1) for context keys and kv offset <= k inside its block (trainer.model.attention's sliding rule).
`dense_block_mask` is the same rule as a dense boolean mask: the reference the sdpa backend and the tests use.

Sparsity: tiles of `tile` x `tile` (128: flex's kernel block). A q-tile holds tile/B consecutive anchors; for sorted
anchors, the context tiles below the smallest anchor are *full* (no mask_mod evaluated), the few tiles around the
anchors are *partial*, the rest are skipped; of the block region only the diagonal tile is visited (partial). So the
kernel does ~(anchor/tile + 2) tiles of work per q-tile instead of KV/tile for a dense masked kernel.

Static buffers, no host sync. `FlexBlockMask` allocates the layout tensors (anchor, ctx_lo, valid) and every BlockMask
tensor once, with shapes fixed by `BlockLayoutShape`. `update_()` recomputes the tile tables on the device and writes
them, and the layout, IN PLACE: a CUDA graph captured over `flex_block_attention` (or over `update_` itself) sees the
fresh mask on every replay. Never rebind the buffers (a replay would read stale memory).

Thread affinity: the first call of `flex_block_attention` compiles (Dynamo/Inductor are not thread-safe): make it in
the main thread during warm-up, before workers start.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.nn.attention.flex_attention import BlockMask, flex_attention

_BLOCK_MASK_FIELDS = (
    "kv_num_blocks",
    "kv_indices",
    "full_kv_num_blocks",
    "full_kv_indices",
    "q_num_blocks",
    "q_indices",
    "full_q_num_blocks",
    "full_q_indices",
)


@dataclass(frozen=True)
class BlockLayoutShape:
    """Static shape of one step's block-attention layout. Validated so tiles never straddle two regions."""

    batch: int
    ctx_len: int
    num_anchors: int
    block_size: int
    tile: int = 128

    def __post_init__(self) -> None:
        if min(self.batch, self.ctx_len, self.num_anchors, self.block_size, self.tile) < 1:
            raise ValueError(f"all BlockLayoutShape fields must be >= 1: {self}")
        if self.ctx_len % self.tile or (self.num_anchors * self.block_size) % self.tile or self.tile % self.block_size:
            raise ValueError(
                f"flex layout needs ctx_len ({self.ctx_len}) and num_anchors*block_size "
                f"({self.num_anchors * self.block_size}) to be multiples of tile ({self.tile}), and tile a multiple "
                f"of block_size ({self.block_size}); pad the context / anchor count"
            )

    @property
    def q_len(self) -> int:
        return self.num_anchors * self.block_size

    @property
    def kv_len(self) -> int:
        return self.ctx_len + self.q_len


def dense_block_mask(anchor: torch.Tensor, ctx_lo: torch.Tensor, valid: torch.Tensor, ctx_len: int, block_size: int,
                     window: int | None = None):
    """Boolean mask [batch, 1, Q, KV] (True = attend) of the layout rule in the module docstring. Pure, no sync."""
    b, n = anchor.shape
    dev = anchor.device
    kv = torch.arange(ctx_len + n * block_size, device=dev)
    q = torch.arange(n * block_size, device=dev)
    j, off = q // block_size, q % block_size  # query -> its block, its offset in it
    a, lo, v = anchor[:, j, None], ctx_lo[:, j, None], valid[:, j, None]  # [b, Q, 1]
    in_ctx = (kv < ctx_len) & (kv >= lo) & (kv < a) & v
    in_blk = (kv >= ctx_len) & ((kv - ctx_len) // block_size == j[:, None])
    if window is not None:
        in_ctx = in_ctx & (kv >= a + off[:, None] - (window - 1))
        in_blk = in_blk & ((kv - ctx_len) % block_size <= off[:, None])
    return (in_ctx | in_blk).unsqueeze(1)


def tile_states(anchor: torch.Tensor, ctx_lo: torch.Tensor, valid: torch.Tensor, shape: BlockLayoutShape,
                window: int | None = None):
    """(partial, full) boolean tile tables [batch, 1, Q/tile, KV/tile] for the layout. Pure, device-side, no sync.

    A tile is full if every (query, key) pair in it is visible, partial if some are, absent otherwise. With a
    window, a block's queries have lower bounds from anchor - (W - 1) (offset 0) to anchor + B - W (offset B-1):
    full needs the largest below the tile, partial the smallest below its end.
    """
    per_tile = shape.tile // shape.block_size
    q_tiles, ctx_tiles = shape.q_len // shape.tile, shape.ctx_len // shape.tile
    lo = ctx_lo.view(shape.batch, q_tiles, per_tile, 1)
    hi = torch.where(valid, anchor, ctx_lo).clamp_min(ctx_lo).view(shape.batch, q_tiles, per_tile, 1)
    lo_all, lo_any = lo, lo
    if window is not None:
        a = anchor.view(shape.batch, q_tiles, per_tile, 1)
        lo_all = torch.maximum(lo, a + shape.block_size - window)
        lo_any = torch.maximum(lo, a - (window - 1))
    t0 = torch.arange(ctx_tiles, device=anchor.device) * shape.tile
    t1 = t0 + shape.tile
    ctx_full = ((lo_all <= t0) & (hi >= t1)).all(dim=2)  # [b, q_tiles, ctx_tiles]
    ctx_any = (torch.maximum(lo_any, t0) < torch.minimum(hi, t1)).any(dim=2)
    # Block region: q-tile i and key-tile i hold the same blocks; only that diagonal tile is visible (full only when
    # it is one whole bidirectional block).
    diag = torch.eye(q_tiles, dtype=torch.bool, device=anchor.device).expand(shape.batch, q_tiles, q_tiles)
    no_blk = torch.zeros_like(diag)
    blk_full, blk_partial = (diag, no_blk) if per_tile == 1 and window is None else (no_blk, diag)
    full = torch.cat([ctx_full, blk_full], dim=-1)
    partial = torch.cat([ctx_any & ~ctx_full, blk_partial], dim=-1)
    return partial.unsqueeze(1), full.unsqueeze(1)


def _ordered(dense: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Dense 0/1 tile table -> (count per row, column indices with the set ones first), as flex expects."""
    dense = dense.to(torch.int32)
    count = dense.sum(dim=-1, dtype=torch.int32)
    order = torch.argsort(dense, dim=-1, descending=True, stable=True).to(torch.int32)
    return count, order


def block_mask_tensors(partial: torch.Tensor, full: torch.Tensor) -> dict[str, torch.Tensor]:
    """Every BlockMask index tensor (kv_* rows and the transposed q_* rows used by the backward)."""
    kv_num, kv_idx = _ordered(partial)
    fkv_num, fkv_idx = _ordered(full)
    q_num, q_idx = _ordered(partial.transpose(-2, -1))
    fq_num, fq_idx = _ordered(full.transpose(-2, -1))
    return {
        "kv_num_blocks": kv_num,
        "kv_indices": kv_idx,
        "full_kv_num_blocks": fkv_num,
        "full_kv_indices": fkv_idx,
        "q_num_blocks": q_num,
        "q_indices": q_idx,
        "full_q_num_blocks": fq_num,
        "full_q_indices": fq_idx,
    }


class FlexBlockMask:
    """Static layout buffers + a BlockMask over them, rewritten in place by `update_()` (see the module docstring)."""

    def __init__(self, shape: BlockLayoutShape, device: torch.device | str, window: int | None = None) -> None:
        self.shape = shape
        self.window = window
        dev = torch.device(device)
        use_tuned_options(dev)
        n = shape.num_anchors
        # Placeholder layout: anchors spread evenly, all valid (any valid layout would do; update_ overwrites it).
        spread = (torch.arange(n, device=dev) * shape.ctx_len // n).expand(shape.batch, n)
        self.anchor = spread.contiguous().to(torch.int32)
        self.ctx_lo = torch.zeros(shape.batch, n, dtype=torch.int32, device=dev)
        self.valid = torch.ones(shape.batch, n, dtype=torch.bool, device=dev)
        # What mask_mod reads: each block's visible context range [ctx_start, ctx_end), empty for an invalid block.
        # One range instead of anchor, ctx_lo and valid: fewer operations per element of every partial tile.
        self.ctx_start, self.ctx_end = self.ctx_lo.clone(), self.anchor.clone()
        tensors = block_mask_tensors(*tile_states(self.anchor, self.ctx_lo, self.valid, shape, window))
        self.block_mask = BlockMask.from_kv_blocks(
            tensors["kv_num_blocks"],
            tensors["kv_indices"],
            tensors["full_kv_num_blocks"],
            tensors["full_kv_indices"],
            BLOCK_SIZE=shape.tile,
            mask_mod=self._mask_mod(),
            seq_lengths=(shape.q_len, shape.kv_len),
        )
        self._copy_tables(tensors)

    def _mask_mod(self):
        start, end = self.ctx_start, self.ctx_end  # the static buffers, read at kernel time
        s, bs, w = self.shape.ctx_len, self.shape.block_size, self.window

        # Per row (query) the block j, its context range and its own keys [first, first + bs); per element only
        # compares. An anchor lies inside the context (end <= ctx_len), so the two ranges never overlap.
        def mask_mod(b, h, q_idx, kv_idx):
            j = q_idx // bs
            first = s + j * bs
            in_ctx = (kv_idx >= start[b, j]) & (kv_idx < end[b, j])
            return in_ctx | ((kv_idx >= first) & (kv_idx < first + bs))

        def sliding_mask_mod(b, h, q_idx, kv_idx):
            j, k = q_idx // bs, q_idx % bs
            first = s + j * bs
            in_ctx = (kv_idx >= start[b, j]) & (kv_idx >= end[b, j] + k - (w - 1)) & (kv_idx < end[b, j])
            return in_ctx | ((kv_idx >= first) & (kv_idx <= first + k))

        return mask_mod if w is None else sliding_mask_mod

    def _copy_tables(self, tensors: dict[str, torch.Tensor]) -> None:
        for name in _BLOCK_MASK_FIELDS:
            getattr(self.block_mask, name).copy_(tensors[name])

    def update_(self, anchor: torch.Tensor, ctx_lo: torch.Tensor, valid: torch.Tensor) -> None:
        """Write a new layout and its tile tables in place. Device-side only: capturable, no host sync.

        anchor, ctx_lo: int [batch, num_anchors] (anchor positions, sorted ascending per row for good sparsity; first
        visible context position per anchor). valid: bool [batch, num_anchors].
        """
        want = (self.shape.batch, self.shape.num_anchors)
        for name, t in (("anchor", anchor), ("ctx_lo", ctx_lo), ("valid", valid)):
            if tuple(t.shape) != want:
                raise ValueError(f"FlexBlockMask.update_: {name} has shape {tuple(t.shape)}, expected {want}")
        self.anchor.copy_(anchor)
        self.ctx_lo.copy_(ctx_lo)
        self.valid.copy_(valid)
        self.ctx_start.copy_(torch.where(self.valid, self.ctx_lo, 0))
        # no `kv < ctx_len` bound in mask_mod: an anchor is a context position, the clamp keeps it so
        self.ctx_end.copy_(torch.where(self.valid, self.anchor.clamp_max(self.shape.ctx_len), 0))
        self._copy_tables(block_mask_tensors(*tile_states(self.anchor, self.ctx_lo, self.valid, self.shape,
                                                          self.window)))


def fwd_options(block_m: int, block_n: int, stages: int, warps: int) -> dict:
    """flex kernel_options for the forward kernel alone (torch's flex lowering strips the fwd_ prefix)."""
    return {"fwd_BLOCK_M": block_m, "fwd_BLOCK_N": block_n, "fwd_num_stages": stages, "fwd_num_warps": warps}


def bwd_options(block_m: int, block_n: int, stages: int, warps: int) -> dict:
    """flex kernel_options for the backward kernel alone: dK/dV tiles block_m x block_n, dQ tiles block_n x block_m."""
    return {"bwd_BLOCK_M1": block_m, "bwd_BLOCK_N1": block_n, "bwd_BLOCK_M2": block_n, "bwd_BLOCK_N2": block_m,
            "bwd_num_stages": stages, "bwd_num_warps": warps}


# bf16 flex kernel_options on Hopper (sm90), per attention (the drafter's block attention, the target's doc-causal
# one) and head dim: the configurations `python -m bench.attention` measured faster than torch's defaults at the
# step's shapes (docs/benchmarks.md "Attention kernels"). Every other GPU, dtype and head dim runs torch's defaults.
SM90_KERNEL_OPTIONS: dict[str, dict[int, dict]] = {
    "drafter": {64: {**fwd_options(64, 128, 3, 4), **bwd_options(64, 64, 3, 4)},
                128: fwd_options(128, 128, 3, 8)},
    "target": {64: fwd_options(128, 64, 3, 4),
               128: fwd_options(64, 64, 3, 4)},
}
_active_options: dict[tuple, dict] = {}  # (attention, device type, device index, dtype, head dim) -> kernel_options


def use_tuned_options(device: torch.device) -> None:
    """Turn the measured kernel_options on for this device if it is a Hopper GPU. Called where a static mask is built
    (the main thread, in warm-up, before the first flex call traces), so that the lookup inside the compiled step is
    a plain dict read; per device, so a host that mixes GPU generations gives each its own."""
    if device.type != "cuda":
        return
    index = device.index if device.index is not None else torch.cuda.current_device()
    if torch.cuda.get_device_capability(index) == (9, 0):
        for attention, by_head_dim in SM90_KERNEL_OPTIONS.items():
            for head_dim, options in by_head_dim.items():
                _active_options[(attention, "cuda", index, torch.bfloat16, head_dim)] = options


def options_for(attention: str, device: torch.device, dtype: torch.dtype, head_dim: int) -> dict | None:
    """The kernel_options `use_tuned_options` turned on for this attention on (device, dtype, head dim), or None:
    torch's defaults."""
    return _active_options.get((attention, device.type, device.index, dtype, head_dim))


def tuned_options(attention: str, q: torch.Tensor) -> dict | None:
    return options_for(attention, q.device, q.dtype, q.shape[-1])


_compiled_flex = None


def compiled_flex_attention():
    """The process-wide compiled flex_attention (eager flex allocates during capture and is slow).

    One compiled entry per (shapes, mask rule, mask buffers): the drafter's block mask, the target's doc-causal
    masks (one per kind of layer), each of their static buffers. Past Dynamo's recompile limit (8) a new one would
    silently run eager flex -- slow, and a failure inside a CUDA graph capture -- so the limit is raised to what a
    process that builds several targets and drafters (the quality pipeline, the test suite) needs."""
    global _compiled_flex
    if _compiled_flex is None:
        import torch._dynamo.config as dynamo_config

        dynamo_config.recompile_limit = max(dynamo_config.recompile_limit, 64)
        _compiled_flex = torch.compile(flex_attention, dynamic=False)
    return _compiled_flex


def flex_block_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: FlexBlockMask | BlockMask):
    """q [batch, Hq, Q, D]; k, v [batch, Hkv, KV, D] (Hq a multiple of Hkv) -> [batch, Hq, Q, D]."""
    block_mask = mask.block_mask if isinstance(mask, FlexBlockMask) else mask
    gqa = q.shape[1] != k.shape[1]
    return compiled_flex_attention()(q, k, v, block_mask=block_mask, enable_gqa=gqa,
                                     kernel_options=tuned_options("drafter", q))


# --- Integration with trainer.model.attention (the trainer's BlockLayout) -------------------------------------------

_static_masks: dict[tuple, FlexBlockMask] = {}


def doc_start_of_anchor(doc_ids: torch.Tensor, anchor_pos: torch.Tensor) -> torch.Tensor:
    """[R, N]: first position of the contiguous run of equal doc ids that holds each anchor. Device-side, no sync.

    Equals the trainer's rule "same document and before the anchor" when each document is one contiguous run in its
    row, which packing guarantees (trainer.data.packing).
    """
    s = doc_ids.shape[1]
    idx = torch.arange(s, device=doc_ids.device).expand_as(doc_ids)
    is_start = torch.ones_like(doc_ids, dtype=torch.bool)
    is_start[:, 1:] = doc_ids[:, 1:] != doc_ids[:, :-1]
    run_start = torch.where(is_start, idx, torch.zeros_like(idx)).cummax(dim=1).values
    return run_start.gather(1, anchor_pos)


def static_mask_for(shape: BlockLayoutShape, device: torch.device, window: int | None = None) -> FlexBlockMask:
    """The process-wide static FlexBlockMask for (shape, device, window): built once, rewritten in place by every
    step.

    One per device is enough because each micro-step's backward finishes before the next micro-step rebuilds it, and
    exactly one thread drives a device. Built lazily: the first call must come from the main thread (warm-up).
    """
    key = (shape, torch.device(device), window)
    if key not in _static_masks:
        _static_masks[key] = FlexBlockMask(shape, device, window)
    return _static_masks[key]


def build_block_mask(layout, window: int | None = None) -> BlockMask:
    """The flex backend's `mask_fn` (trainer.model.attention.make_layout / TrainState.mask_fn): rewrites the static
    BlockMask for this layout's shape, device and window in place and returns it. Device-side only: capturable."""
    r, n = layout.anchor_pos.shape
    shape = BlockLayoutShape(r, layout.doc_ids.shape[1], n, layout.block_size)
    mask = static_mask_for(shape, layout.anchor_pos.device, window)
    ctx_lo = getattr(layout, "ctx_lo", None)
    if ctx_lo is None:  # older layouts: derive the document start from the doc ids
        ctx_lo = doc_start_of_anchor(layout.doc_ids, layout.anchor_pos)
    mask.update_(layout.anchor_pos, ctx_lo, layout.anchor_valid)
    return mask.block_mask

