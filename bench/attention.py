"""Flex attention kernel configurations at the step's shapes: `python -m bench.attention --shape small --docs 1`.

Times, for each candidate `kernel_options` of torch's flex attention, the two attentions of the training step with
the trainer's own masks over synthetic batches (bench.synthetic, as bench.step builds them):
  drafter  its block attention (trainer.model.flex.FlexBlockMask): the rows' anchor blocks over context + blocks,
           forward and backward, bf16
  target   the frozen target's doc-causal attention (trainer.model.doc_attention.DocCausalMask), forward only
Heads and head dim are the named shape's (bench/shapes.py); random q, k, v. Each configuration compiles its own
kernels (Dynamo recompiles per kernel_options), then runs `--reps` calls between CUDA events after 3 untimed ones.

Prints one `ATTN {json}` line per (attention, configuration): forward ms, backward ms (the backward alone
between its events), TFLOP/s of the allowed query-key pairs (4 * head_dim * heads FLOPs per pair forward, 2.5 times that
backward: its five products to the forward's two), and the largest relative difference (norm of the difference over
the norm) of the output and, for the drafter, of dq, dk, dv from the default configuration's; a configuration the
kernel refuses prints its error instead. Then `ATTN_CHOICE {json}`: per attention the fastest forward and backward
configuration, and the kernel_options that take each of them only where it is at least 3% faster than torch's
default (the rule `SM90_KERNEL_OPTIONS` was written by), with the GPU and torch version. CUDA only.
"""
from __future__ import annotations

import argparse
import json
import sys

MARGIN = 0.03  # a configuration replaces torch's default only when at least this much faster


def candidates():
    """name -> kernel_options: torch's defaults, the trainer's own choice for the attention and head dim (`tuned`,
    added per attention by configs_for), then forward-only and backward-only configurations (each leaves the other
    kernel at its default), in trainer.model.flex's prefixed form."""
    from trainer.model.flex import bwd_options, fwd_options

    fwd = {f"f{m}x{n}s{s}w{w}": fwd_options(m, n, s, w)
           for m, n, s, w in ((128, 64, 3, 4), (128, 128, 3, 8), (128, 128, 2, 8), (64, 128, 3, 4), (128, 64, 4, 8),
                              (128, 64, 3, 8), (64, 64, 3, 4))}
    bwd = {f"b{m}x{n}s{s}w{w}": bwd_options(m, n, s, w)
           for m, n, s, w in ((64, 64, 3, 4), (64, 128, 3, 8), (64, 128, 2, 8), (32, 128, 3, 4), (64, 64, 4, 4),
                              (32, 64, 3, 4), (64, 128, 3, 4), (128, 64, 2, 8), (64, 64, 3, 8), (128, 128, 2, 8))}
    return {"default": {}, **fwd, "tma": {"fwd_USE_TMA": True}, **bwd, "btma": {"bwd_USE_TMA": True}}


def configs_for(attention: str, head_dim: int) -> dict[str, dict]:
    """The candidates for one attention, with `tuned` (trainer.model.flex.SM90_KERNEL_OPTIONS) where the trainer has
    a choice for it. The target runs forward only: its backward configurations would time the same kernel again."""
    from trainer.model.flex import SM90_KERNEL_OPTIONS

    every = candidates()
    tuned = SM90_KERNEL_OPTIONS[attention].get(head_dim)
    if tuned:
        every = {"default": {}, "tuned": tuned, **every}
    if attention == "target":
        return {name: options for name, options in every.items() if not any(k.startswith("bwd_") for k in options)}
    return every


def tflops(pairs: float, head_dim: int, heads: int, ms: float, backward: bool = False) -> float:
    """Pure: attention TFLOP/s for `pairs` allowed query-key pairs (forward: QK^T and PV, 2 FLOPs per multiply-add
    each; backward: the recomputed QK^T, dV, dP, dQ and dK, 2.5 times the forward)."""
    flops = 4.0 * head_dim * heads * pairs * (2.5 if backward else 1.0)
    return flops / (ms * 1e-3) / 1e12 if ms > 0 else float("nan")


def best(rows: list[dict]) -> dict:
    """Pure: per attention, the configuration with the lowest forward ms and the one with the lowest backward ms;
    a forward among those that leave the backward kernel as it is (no bwd_ option), and the other way round."""
    out: dict[str, dict] = {}
    for r in rows:
        if "error" in r:
            continue
        slot = out.setdefault(r["attention"], {})
        for part, other in (("fwd_ms", "bwd_"), ("bwd_ms", "fwd_")):
            if any(key.startswith(other) for key in r["options"]) or r.get(part) is None:
                continue
            if part not in slot or r[part] < slot[part][1]:
                slot[part] = (r["config"], r[part])
    return out


def choice(rows: list[dict], margin: float = MARGIN) -> dict:
    """Pure: per attention, `best` and the kernel_options to keep: the fastest forward's and the fastest backward's,
    each only where it beats the default configuration by `margin`."""
    out = {}
    for attention, slot in best(rows).items():
        default = next((r for r in rows
                        if r["attention"] == attention and r["config"] == "default" and "error" not in r), None)
        options: dict = {}
        for part in ("fwd_ms", "bwd_ms"):
            if default is None or part not in slot or default.get(part) is None:
                continue
            name, ms = slot[part]
            if ms <= (1 - margin) * default[part]:
                options.update(next(r["options"] for r in rows if r["attention"] == attention and r["config"] == name))
        out[attention] = {**slot, "options": options}
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.attention", description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", default="small", help="named target shape (bench/shapes.py)")
    p.add_argument("--batch", type=int, default=4, help="rows (default: 4)")
    p.add_argument("--seq", type=int, default=3072, help="tokens per row (default: 3072)")
    p.add_argument("--anchors", type=int, default=512, help="anchors per row (default: 512)")
    p.add_argument("--docs", type=int, default=1, help="documents per row (default: 1)")
    p.add_argument("--block", type=int, default=16, help="block size (default: 16)")
    p.add_argument("--reps", type=int, default=20, help="timed calls per configuration (default: 20)")
    p.add_argument("--only", default="", help="comma list of configuration names (default: all); `default` always "
                                              "runs, and a name that does not apply to an attention is skipped")
    p.add_argument("--attention", default="drafter,target", help="comma list of drafter, target (default: both)")
    p.add_argument("--layout", default="heads", choices=("heads", "tokens"),
                   help="q, k, v memory order: heads = [rows, heads, tokens, dim] contiguous; tokens = [rows, tokens, "
                        "heads, dim] viewed as the former (what a projection followed by a transpose gives)")
    a = p.parse_args(argv)
    from bench.shapes import SHAPES

    if a.shape not in SHAPES:
        p.error(f"unknown --shape {a.shape!r}; choose one of {sorted(SHAPES)}")
    from trainer.model.doc_attention import TILE  # the masks' sparse block

    names = [n for n in a.only.split(",") if n]
    known = {*candidates(), "tuned"}
    unknown = [n for n in names if n not in known]
    if unknown:
        p.error(f"unknown --only configuration(s) {unknown}; choose from {sorted(known)}")
    low = [n for n in ("batch", "seq", "anchors", "docs", "reps") if getattr(a, n) < 1]
    if low or a.block < 2:
        p.error(f"--{low[0]} must be >= 1" if low else "--block must be >= 2")
    if a.seq % TILE or (a.anchors * a.block) % TILE or TILE % a.block:
        p.error(f"--seq and --anchors x --block must be multiples of {TILE}, and {TILE} of --block (the masks' "
                f"tiles)")
    if a.anchors > a.seq - a.docs:
        p.error("--anchors must be <= --seq - --docs (every anchor needs a candidate position)")
    attentions = [n for n in a.attention.split(",") if n]
    if not attentions or set(attentions) - {"drafter", "target"}:
        p.error(f"--attention {a.attention!r}: a comma list of drafter, target")
    import torch

    if not torch.cuda.is_available():
        raise SystemExit("bench.attention times CUDA kernels and this machine has no CUDA GPU")
    import torch._dynamo.config as dynamo_config

    # past the recompile limit a configuration would run as eager flex, which ignores kernel_options: fail instead
    if hasattr(dynamo_config, "fail_on_recompile_limit_hit"):
        dynamo_config.fail_on_recompile_limit_hit = True
    rows = [row for attention in attentions for row in run(attention, a, SHAPES[a.shape], names)]
    env = {"device": torch.cuda.get_device_name(), "capability": list(torch.cuda.get_device_capability()),
           "torch": torch.__version__}
    print("ATTN_CHOICE " + json.dumps({"attentions": choice(rows), **env}), flush=True)
    return 0


def inputs(attention: str, a, shape: dict):
    """-> (q, k, v, output grad or None, block mask, allowed query-key pairs) on CUDA for one attention."""
    import torch

    from bench.synthetic import draft_pairs, synthetic_batches, target_pairs
    from trainer.model.doc_attention import DocCausalMask
    from trainer.model.flex import BlockLayoutShape, FlexBlockMask, doc_start_of_anchor

    dev = torch.device("cuda")
    batch = synthetic_batches(1, a.batch, a.seq, a.anchors, shape["vocab_size"], seed=0, docs_per_row=a.docs)[0]
    heads, kv_heads, hd = shape["num_attention_heads"], shape["num_key_value_heads"], shape["head_dim"]
    gen = torch.Generator(device=dev).manual_seed(0)

    def rand(h: int, tokens: int, grad: bool):
        if a.layout == "tokens":
            x = torch.randn(a.batch, tokens, h, hd, device=dev, dtype=torch.bfloat16, generator=gen).transpose(1, 2)
        else:
            x = torch.randn(a.batch, h, tokens, hd, device=dev, dtype=torch.bfloat16, generator=gen)
        return x.requires_grad_(grad)

    if attention == "drafter":
        layout = BlockLayoutShape(a.batch, a.seq, a.anchors, a.block)
        mask = FlexBlockMask(layout, dev)
        anchor = batch.anchor_pos.to(dev)
        mask.update_(anchor, doc_start_of_anchor(batch.doc_ids.to(dev), anchor), batch.anchor_valid.to(dev))
        q, kv = layout.q_len, layout.kv_len
        return (rand(heads, q, True), rand(kv_heads, kv, True), rand(kv_heads, kv, True), rand(heads, q, False),
                mask.block_mask, draft_pairs(batch, a.block))
    block_mask = DocCausalMask(a.batch, a.seq, dev).update_(batch.doc_ids.to(dev).to(torch.int32))
    return (rand(heads, a.seq, False), rand(kv_heads, a.seq, False), rand(kv_heads, a.seq, False), None, block_mask,
            target_pairs(batch))


def run(attention: str, a, shape: dict, names: list[str]) -> list[dict]:
    """Time every selected configuration of one attention -> its ATTN rows (printed as they come)."""
    from bench.timing import median_backward_ms, median_call_ms
    from trainer.model.flex import compiled_flex_attention

    heads, kv_heads, hd = shape["num_attention_heads"], shape["num_key_value_heads"], shape["head_dim"]
    q, k, v, grad, block_mask, pairs = inputs(attention, a, shape)
    fn = compiled_flex_attention()  # the process-wide compiled instance the trainer calls
    reference = None
    rows = []
    for name, options in configs_for(attention, hd).items():
        if names and name not in names and name != "default":
            continue
        row = {"attention": attention, "shape": a.shape, "docs": a.docs, "layout": a.layout, "config": name,
               "options": options}

        def call(options=options):
            return fn(q, k, v, block_mask=block_mask, enable_gqa=heads != kv_heads, kernel_options=options)

        def fresh_call():  # no gradient left to accumulate into: the backward alone is timed
            q.grad = k.grad = v.grad = None
            return call()

        try:
            fwd = median_call_ms(call, a.reps)
            row.update(fwd_ms=fwd, fwd_tflops=round(tflops(pairs, hd, heads, fwd), 1))
            if grad is not None:
                bwd = median_backward_ms(fresh_call, grad, a.reps)
                row.update(bwd_ms=bwd, bwd_tflops=round(tflops(pairs, hd, heads, bwd, backward=True), 1))
            got = results(call, grad, (q, k, v))
            reference = got if reference is None else reference
            row["rel_diff_vs_default"] = max(float((g - r).norm() / r.norm().clamp_min(1e-30))
                                             for g, r in zip(got, reference))
        except Exception as e:  # a configuration the kernel cannot build or run: report it, try the next
            row["error"] = f"{type(e).__name__}: {(str(e).splitlines() or [''])[0][:300]}"
        print("ATTN " + json.dumps(row), flush=True)
        rows.append(row)
    return rows


def results(call, grad, inputs) -> list:
    """The output and, with an output gradient, the inputs' gradients, in fp32 (the same compiled entry as timed)."""
    out = call()
    if grad is None:
        return [out.detach().float()]
    out.backward(grad)
    got = [out.detach().float()] + [x.grad.float() for x in inputs]
    for x in inputs:
        x.grad = None
    return got


if __name__ == "__main__":
    sys.exit(main())
