"""The target's forward alone, as the trainer runs it and as the peers run it:
`python -m bench.target --shape qwen3.5-9b --docs 1`.

Run from the repository root. One random-init target of a named shape (bench/shapes.py), truncated after the last
tap of a 5-layer drafter, bf16 on CUDA, frozen; batch x seq token rows of `--docs` packed documents (bench/synthetic.py):
  hf     HF's plain forward of the truncated model (`model.model(input_ids, position_ids)`), eager, HF's own kernels:
         sdpa (gpt-oss: HF's flex_attention, as sdpa is refused), its Gated DeltaNet layers through fla where fla
         imports, its grouped-GEMM experts. No document mask: right at one document per row only, the setting the
         peers train in, so `--docs` above 1 is refused for it.
  ours   `trainer.model.target.Target.features` as the step computes it: the doc-causal flex masks, the packed
         Gated DeltaNet layers, every decoder layer torch.compile'd, the whole forward one captured CUDA graph.
Prints one `TARGET {json}` line per implementation: median ms per forward, tokens/s, peak memory. With bench.step's
whole step on the same shape (the same run), the peers' step is the hf forward plus the step's drafter part
(docs/benchmarks.md, "The 2026 families").
"""
from __future__ import annotations

import argparse
import json


def main(argv: list[str] | None = None) -> int:
    from bench.shapes import SHAPES

    p = argparse.ArgumentParser(prog="python -m bench.target", description=" ".join(__doc__.split("\n\n")[0].split()))
    p.add_argument("--shape", default="small", help=f"named shape: {', '.join(SHAPES)}")
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq", type=int, default=3072)
    p.add_argument("--docs", type=int, default=1, help="documents per row (hf: 1 only)")
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--impls", default="hf,ours", help="comma-separated: hf, ours")
    a = p.parse_args(argv)
    if a.shape not in SHAPES:
        p.error(f"unknown --shape {a.shape!r}; choose one of {', '.join(SHAPES)}")
    impls = a.impls.split(",")
    if set(impls) - {"hf", "ours"}:
        p.error(f"--impls takes hf and ours, got {a.impls!r}")
    if "hf" in impls and a.docs != 1:
        p.error("--impls hf computes a plain forward with no document mask: --docs 1 only")
    for impl in impls:
        print("TARGET " + json.dumps(run(a, impl)), flush=True)
    return 0


def build(a, impl: str, device):
    """The prepared target (ours) or the bare truncated HF model (hf), random init, bf16."""
    import torch
    from transformers import AutoModelForCausalLM

    from bench.shapes import target_config
    from trainer.model.target import hf_attention, load_options, prepare_target
    from trainer.tiny import build_tokenizer

    config = target_config(a.shape, a.seq)
    attention = hf_attention(config)
    if impl == "hf" and attention == "eager":
        attention = "flex_attention"  # what the peers run gpt-oss with: HF refuses sdpa for it
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16, attn_implementation=attention,
                                                 **load_options(config))
    target = prepare_target(model, build_tokenizer(), num_draft_layers=5, attn="flex" if impl == "ours" else "sdpa")
    if impl == "ours":
        for layer in target.model.model.layers:
            layer.compile(dynamic=False)
    return target


def run(a, impl: str) -> dict:
    import torch

    from bench.synthetic import synthetic_batches
    from bench.timing import median_call_ms, peak_memory, reset_peak
    from trainer.capture import capture

    device = torch.device("cuda")
    target = build(a, impl, device)
    vocab = target.embed_tokens.weight.shape[0]
    batch = synthetic_batches(1, a.batch, a.seq, 16, vocab, seed=0, docs_per_row=a.docs)[0]
    ids, pos, doc = (t.to(device) for t in (batch.input_ids, batch.position_ids, batch.doc_ids))

    if impl == "ours":
        def forward():
            return target.features(ids, pos, doc)
    else:
        @torch.no_grad()
        def forward():
            return target.model.model(input_ids=ids, position_ids=pos, use_cache=False).last_hidden_state

    reset_peak(device)
    call = forward
    if impl == "ours":
        graph, _out = capture(forward, device, warmup=3)
        call = graph.replay
    else:
        for _ in range(2):
            forward()
    ms = median_call_ms(call, a.reps)
    peak, _reserved = peak_memory(device)
    tokens = a.batch * a.seq
    return {"impl": impl, "shape": a.shape, "docs_per_row": a.docs, "layers_run": len(target.model.model.layers),
            "ms": ms, "tokens_per_s": tokens / ms * 1e3, "peak_alloc_gib": peak, "torch": torch.__version__,
            "device": torch.cuda.get_device_name(device)}


if __name__ == "__main__":
    raise SystemExit(main())
