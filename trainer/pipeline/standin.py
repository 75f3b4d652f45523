"""Self-contained DFlash workload for the benchmark and the GPU tests: a Qwen3-like target, a 5-layer drafter with KV
injection, the block layout and a chunked LM-head cross-entropy.

Why it exists: the graph/pipeline/bench code must be built and measured before the trainer core (config, HF target
loading, the drafter model, StaticBatch) lands. It follows research/dflash.md sections 1-2 closely enough that its
FLOPs, memory and kernel mix are the real ones; it is *not* the trainer's model and loads no checkpoints.

Shapes: B rows of S context tokens; N anchors per row; block size BS; Q = N*BS drafted positions per row.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from trainer.model.flex import BlockLayoutShape, FlexBlockMask, dense_block_mask, flex_block_attention


@dataclass(frozen=True)
class ModelShape:
    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    target_layers: int
    draft_layers: int = 5

    @property
    def tap_layers(self) -> tuple[int, ...]:
        """Tapped target layers: uniformly from layer 1 to layer n-3, one per draft layer (dflash.md section 1)."""
        n, k = self.target_layers, self.draft_layers
        if k == 1:
            return (n // 2,)
        start, end = 1, n - 3
        return tuple(int(round(start + i * (end - start) / (k - 1))) for i in range(k))


QWEN3_8B = ModelShape(4096, 12288, 32, 8, 128, 151936, 36)
SMALL = ModelShape(1024, 3072, 16, 8, 64, 151936, 12)
TINY = ModelShape(256, 512, 4, 2, 64, 1024, 8)


def rope_tables(head_dim: int, max_pos: int, device, theta: float = 1_000_000.0):
    inv = 1.0 / theta ** (torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim)
    ang = torch.arange(max_pos, device=device, dtype=torch.float32)[:, None] * inv
    ang = torch.cat([ang, ang], dim=-1)
    return ang.cos(), ang.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [B, L, H, D]; cos/sin [B, L, D] (gathered at the positions)."""
    c, s = cos[:, :, None, :].to(x.dtype), sin[:, :, None, :].to(x.dtype)
    x1, x2 = x.chunk(2, dim=-1)
    return x * c + torch.cat([-x2, x1], dim=-1) * s


class RMSNorm(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dt = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)
        return (x * self.weight.float()).to(dt)


class Mlp(nn.Module):
    def __init__(self, s: ModelShape) -> None:
        super().__init__()
        self.gate = nn.Linear(s.hidden, s.intermediate, bias=False)
        self.up = nn.Linear(s.hidden, s.intermediate, bias=False)
        self.down = nn.Linear(s.intermediate, s.hidden, bias=False)

    def forward(self, x):
        return self.down(F.silu(self.gate(x)) * self.up(x))


class Attn(nn.Module):
    def __init__(self, s: ModelShape) -> None:
        super().__init__()
        self.s = s
        self.q = nn.Linear(s.hidden, s.heads * s.head_dim, bias=False)
        self.k = nn.Linear(s.hidden, s.kv_heads * s.head_dim, bias=False)
        self.v = nn.Linear(s.hidden, s.kv_heads * s.head_dim, bias=False)
        self.o = nn.Linear(s.heads * s.head_dim, s.hidden, bias=False)
        self.q_norm = RMSNorm(s.head_dim)
        self.k_norm = RMSNorm(s.head_dim)

    def heads(self, x, proj, n, norm):
        b, l, _ = x.shape
        return norm(proj(x).view(b, l, n, self.s.head_dim))


class TargetLayer(nn.Module):
    def __init__(self, s: ModelShape) -> None:
        super().__init__()
        self.ln1, self.attn, self.ln2, self.mlp = RMSNorm(s.hidden), Attn(s), RMSNorm(s.hidden), Mlp(s)

    def forward(self, x, cos, sin):
        a, s = self.attn, self.attn.s
        h = self.ln1(x)
        q = apply_rope(a.heads(h, a.q, s.heads, a.q_norm), cos, sin).transpose(1, 2)
        k = apply_rope(a.heads(h, a.k, s.kv_heads, a.k_norm), cos, sin).transpose(1, 2)
        v = a.v(h).view(*h.shape[:2], s.kv_heads, s.head_dim).transpose(1, 2)
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        x = x + a.o(o.transpose(1, 2).flatten(2))
        return x + self.mlp(self.ln2(x))


class Target(nn.Module):
    """Frozen target: embedding, the layers up to the last tap, and the LM head (used by the drafter's loss only)."""

    def __init__(self, s: ModelShape, max_pos: int) -> None:
        super().__init__()
        self.s = s
        self.embed = nn.Embedding(s.vocab, s.hidden)
        self.layers = nn.ModuleList(TargetLayer(s) for _ in range(max(s.tap_layers) + 1))
        self.lm_head = nn.Linear(s.hidden, s.vocab, bias=False)
        self.max_pos = max_pos
        self.requires_grad_(False)

    @torch.no_grad()
    def taps(self, input_ids: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """Concatenated tapped hidden states [B, S, taps*hidden] (the outputs of the tapped layers)."""
        b, n = input_ids.shape
        cos, sin = rope_tables(self.s.head_dim, n, input_ids.device)
        cos, sin = cos.expand(b, n, -1), sin.expand(b, n, -1)
        x = self.embed(input_ids)
        feats = []
        for i, layer in enumerate(self.layers):
            x = layer(x, cos, sin)
            if i in self.s.tap_layers:
                feats.append(x)
        if out is None:
            return torch.cat(feats, dim=-1)
        return torch.cat(feats, dim=-1, out=out)


class DraftLayer(nn.Module):
    """Qwen3 layer whose K/V also cover the fused target context (KV injection)."""

    def __init__(self, s: ModelShape) -> None:
        super().__init__()
        self.ln1, self.attn, self.ln2, self.mlp = RMSNorm(s.hidden), Attn(s), RMSNorm(s.hidden), Mlp(s)

    def forward(self, x, ctx, rope_q, rope_kv, block_mask=None, dense_mask=None):
        a, s = self.attn, self.attn.s
        h = self.ln1(x)
        q = apply_rope(a.heads(h, a.q, s.heads, a.q_norm), *rope_q).transpose(1, 2)
        k = torch.cat([a.heads(ctx, a.k, s.kv_heads, a.k_norm), a.heads(h, a.k, s.kv_heads, a.k_norm)], dim=1)
        k = apply_rope(k, *rope_kv).transpose(1, 2)
        v = torch.cat([a.v(ctx), a.v(h)], dim=1).view(*k.shape[:1], -1, s.kv_heads, s.head_dim).transpose(1, 2)
        o = attend(q, k, v, block_mask, dense_mask)
        x = x + a.o(o.transpose(1, 2).flatten(2))
        return x + self.mlp(self.ln2(x))


def attend(q, k, v, block_mask, dense_mask):
    """Block attention: flex over a static BlockMask, or the dense-mask sdpa reference (K/V expanded for GQA)."""
    if block_mask is not None:
        return flex_block_attention(q, k, v, block_mask)
    groups = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=dense_mask)


class Drafter(nn.Module):
    def __init__(self, s: ModelShape) -> None:
        super().__init__()
        self.s = s
        self.fc = nn.Linear(len(s.tap_layers) * s.hidden, s.hidden, bias=False)
        self.hidden_norm = RMSNorm(s.hidden)
        self.layers = nn.ModuleList(DraftLayer(s) for _ in range(s.draft_layers))
        self.norm = RMSNorm(s.hidden)

    def forward(self, noise_emb, taps, rope_q, rope_kv, block_mask=None, dense_mask=None):
        ctx = self.hidden_norm(self.fc(taps))
        x = noise_emb
        for layer in self.layers:
            x = layer(x, ctx, rope_q, rope_kv, block_mask, dense_mask)
        return self.norm(x)


def ce_chunk_eager(logits, labels, weights, inv_total):
    """One chunk of weighted CE from bf16 logits [C, V]: (sum w*ce, argmax hits with w>0, dlogits bf16).

    Eager form: in-place fp32 softmax to limit transients (several passes over [C, V]).
    """
    lf = logits.float()
    lse = torch.logsumexp(lf, dim=-1)
    loss = ((lse - lf.gather(1, labels[:, None]).squeeze(1)) * weights).sum()
    hits = ((lf.argmax(dim=-1) == labels) & (weights > 0)).sum()
    p = lf.sub_(lse[:, None]).exp_()
    p.scatter_add_(1, labels[:, None], -torch.ones_like(lse)[:, None])
    return loss, hits, p.mul_((weights * inv_total)[:, None]).to(logits.dtype)


def ce_chunk_fusable(logits, labels, weights, inv_total):
    """Same contract as `ce_chunk_eager`, written for Inductor: two fused passes over the logits."""
    lf = logits.float()
    m = lf.amax(dim=-1, keepdim=True)
    e = (lf - m).exp()
    se = e.sum(dim=-1, keepdim=True)
    lse = (m + se.log()).squeeze(-1)
    loss = ((lse - lf.gather(1, labels[:, None]).squeeze(1)) * weights).sum()
    hits = ((lf.argmax(dim=-1) == labels) & (weights > 0)).sum()
    onehot = torch.arange(lf.shape[-1], device=lf.device) == labels[:, None]
    grad = (e / se - onehot.float()) * (weights * inv_total)[:, None]
    return loss, hits, grad.to(logits.dtype)


class LinearCrossEntropy(torch.autograd.Function):
    """Weighted CE of `h @ w.T` against labels, chunked over rows so [T, V] logits never exist at once.

    The gradient w.r.t. h is computed in the forward, chunk by chunk (the frozen head needs no weight grad), and saved;
    backward only scales it. Returns (sum(w*ce)/sum(w), argmax hits / count of w>0). No host sync.
    """

    @staticmethod
    def forward(ctx, h, w, labels, weights, chunk: int, chunk_fn):
        total = weights.sum().clamp_min(1e-6)
        inv_total = 1.0 / total
        count = (weights > 0).sum().clamp_min(1)
        grad_h = torch.empty_like(h)
        loss = torch.zeros((), device=h.device, dtype=torch.float32)
        hits = torch.zeros((), device=h.device, dtype=torch.float32)
        for s in range(0, h.shape[0], chunk):  # static Python loop: fixed shapes, capturable
            sl = slice(s, s + chunk)
            logits = h[sl] @ w.t()  # [C, V] bf16: with its fp32 view, the only large transient
            l_c, h_c, g_logits = chunk_fn(logits, labels[sl], weights[sl], inv_total)
            loss += l_c
            hits += h_c
            grad_h[sl] = (g_logits @ w).to(h.dtype)
        ctx.save_for_backward(grad_h)
        return loss * inv_total, hits / count

    @staticmethod
    def backward(ctx, g_loss, g_acc):
        (grad_h,) = ctx.saved_tensors
        return grad_h * g_loss.to(grad_h.dtype), None, None, None, None, None


@dataclass(frozen=True)
class Workload:
    """Static per-step shapes: `accum` micro-steps of `batch` rows of `seq` tokens, `anchors` per row, block `block`."""

    model: ModelShape
    batch: int
    seq: int
    anchors: int
    block: int = 16
    accum: int = 1
    gamma: float = 7.0
    mask_id: int = 5
    ce_chunk: int = 4096

    @property
    def layout(self) -> BlockLayoutShape:
        return BlockLayoutShape(self.batch, self.seq, self.anchors, self.block)

    @property
    def tokens_per_step(self) -> int:
        return self.accum * self.batch * self.seq


def make_batch(w: Workload, device, seed: int) -> dict[str, torch.Tensor]:
    """Random step inputs (accum*batch rows): token ids, loss mask, sorted anchors, doc starts, validity."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    rows = w.accum * w.batch
    ids = torch.randint(0, w.model.vocab, (rows, w.seq), generator=g)
    loss_mask = torch.ones(rows, w.seq, dtype=torch.bool)
    keys = torch.rand(rows, w.seq - w.block, generator=g)
    anchor = keys.topk(w.anchors, dim=1).indices.sort(dim=1).values + 1  # distinct, in [1, S-B]
    ctx_lo = torch.zeros(rows, w.anchors, dtype=torch.int64)
    valid = torch.ones(rows, w.anchors, dtype=torch.bool)
    batch = dict(input_ids=ids, loss_mask=loss_mask, anchor=anchor, ctx_lo=ctx_lo, valid=valid)
    return {k: v.to(device) for k, v in batch.items()}


class DraftStep:
    """forward_backward / optimizer_step callables for `StepGraph`/`EagerStep` over one `Workload`.

    Inputs (all [accum*batch, ...]): taps [.., S, taps*D] bf16, input_ids, loss_mask, anchor, ctx_lo, valid.
    attn: "flex" (block-sparse; one static FlexBlockMask, rewritten in place inside the step before each micro-step,
    which is safe because each micro-step's backward runs before the next forward) or "sdpa" (dense boolean mask, the
    reference). compile: torch.compile (no CUDA graphs) each draft layer.
    """

    def __init__(self, w: Workload, target: Target, drafter: Drafter, opt, *, attn="flex", compile=False, clip=1.0):
        self.w, self.target, self.drafter, self.opt, self.attn, self.clip = w, target, drafter, opt, attn, clip
        dev = next(drafter.parameters()).device
        self.rope = rope_tables(w.model.head_dim, w.seq + w.block, dev)
        self.mask = FlexBlockMask(w.layout, dev) if attn == "flex" else None
        pos = torch.arange(w.block, device=dev)
        self.decay = torch.where(pos > 0, torch.exp(-(pos - 1).clamp_min(0) / w.gamma), torch.zeros(()))
        self.layer_fns = [torch.compile(l, dynamic=False) if compile else l for l in drafter.layers]
        self.ce_fn = torch.compile(ce_chunk_fusable, dynamic=False) if compile else ce_chunk_eager
        self.params = [p for p in drafter.parameters() if p.requires_grad]

    def _micro(self, inp: dict[str, torch.Tensor], i: int) -> tuple[torch.Tensor, torch.Tensor]:
        w, bs = self.w, self.w.block
        sl = slice(i * w.batch, (i + 1) * w.batch)
        ids, lmask, anchor = inp["input_ids"][sl], inp["loss_mask"][sl], inp["anchor"][sl]
        ctx_lo, valid = inp["ctx_lo"][sl], inp["valid"][sl]
        b, s = ids.shape
        pos = (anchor[:, :, None] + torch.arange(bs, device=ids.device)).clamp_max(s - 1 + bs)  # [b, N, BS]
        lab_pos = pos.clamp_max(s - 1)
        noise = torch.full_like(pos, w.mask_id)
        noise[:, :, 0] = ids.gather(1, anchor)
        labels = ids.gather(1, lab_pos.flatten(1)).view_as(pos)
        weight = (valid[:, :, None] & (pos < s) & lmask.gather(1, lab_pos.flatten(1)).view_as(pos)) * self.decay
        cos, sin = self.rope
        qpos = pos.flatten(1)
        rope_q = (cos[qpos], sin[qpos])
        kvpos = torch.cat([torch.arange(s, device=ids.device).expand(b, s), qpos], dim=1)
        rope_kv = (cos[kvpos], sin[kvpos])
        block_mask = dense = None
        if self.mask is not None:
            self.mask.update_(anchor, ctx_lo, valid)  # in place: a captured step re-reads the fresh layout on replay
            block_mask = self.mask.block_mask
        else:
            dense = dense_block_mask(anchor, ctx_lo, valid, s, bs)
        with torch.autocast(ids.device.type, dtype=torch.bfloat16):
            emb = self.target.embed(noise.flatten(1))
            ctx = self.drafter.hidden_norm(self.drafter.fc(inp["taps"][sl]))
            x = emb
            for fn in self.layer_fns:
                x = fn(x, ctx, rope_q, rope_kv, block_mask, dense)
            hid = self.drafter.norm(x).view(b, w.anchors, bs, -1)[:, :, 1:]  # position 0 is the given anchor token
        h = hid.reshape(-1, hid.shape[-1]).to(torch.bfloat16)
        return LinearCrossEntropy.apply(
            h, self.target.lm_head.weight, labels[:, :, 1:].reshape(-1), weight[:, :, 1:].reshape(-1).float(),
            w.ce_chunk,
            self.ce_fn,
        )

    def forward_backward(self, inp: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        loss_sum = acc_sum = None
        for i in range(self.w.accum):
            loss, acc = self._micro(inp, i)
            (loss / self.w.accum).backward()
            loss_sum = loss.detach() if loss_sum is None else loss_sum + loss.detach()
            acc_sum = acc.detach() if acc_sum is None else acc_sum + acc.detach()
        return {"loss": loss_sum / self.w.accum, "acc": acc_sum / self.w.accum}

    def optimizer_step(self) -> dict[str, torch.Tensor]:
        norm = torch.nn.utils.clip_grad_norm_(self.params, self.clip, foreach=True)
        self.opt.step()
        return {"grad_norm": norm}


def build(w: Workload, device, *, seed: int = 0, lr: float = 6e-4, attn="flex", compile=False, fused=True):
    """Target (bf16, frozen), drafter (fp32 params, bf16 autocast), capturable AdamW with a tensor LR, DraftStep."""
    torch.manual_seed(seed)
    with torch.device(device):
        target = Target(w.model, w.seq).to(torch.bfloat16)
        for p in target.parameters():  # random init at a sane scale (default Linear init is fine; embed is N(0,1))
            if p.dim() == 2:
                p.data.normal_(0.0, 0.02)
        drafter = Drafter(w.model)
        for p in drafter.parameters():
            if p.dim() == 2:
                p.data.normal_(0.0, 0.02)
    on_gpu = torch.device(device).type == "cuda"
    opt = torch.optim.AdamW(
        drafter.parameters(),
        lr=torch.tensor(lr, device=device) if on_gpu else lr,
        weight_decay=0.0,
        capturable=on_gpu,
        fused=fused and on_gpu,
        foreach=None if fused and on_gpu else True,
    )
    return target, drafter, opt, DraftStep(w, target, drafter, opt, attn=attn, compile=compile)
