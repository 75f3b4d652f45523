"""Make a real small target here: a Qwen3 (or Qwen3.5 hybrid) causal LM pretrained on the stdlib corpus, saved with its tokenizer.

The output directory is an ordinary HF model directory (`save_pretrained`), read unchanged by `load_target`.
Loop: random windows of a packed token stream, fp32 master weights + bf16 autocast on CUDA, fused AdamW, warmup +
cosine on progress = max(step / steps, elapsed / budget_s) so a run cut by its time budget still ends annealed.
"""
from __future__ import annotations

import json
import math
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from trainer.quality.config import PretrainCfg, QualityCfg, TargetCfg
from trainer.quality.corpus import ENDOFTEXT, build_tokenizer, corpus_root, corpus_split, pretraining_documents


@dataclass(frozen=True)
class PretrainResult:
    path: str
    params: int
    files_heldin: int
    files_heldout: int
    corpus_tokens: int
    steps: int
    tokens_seen: int
    final_loss: float
    heldout_loss: float
    seconds: float
    stopped_by: str  # "steps" or "budget"
    files_drafter_only: int = 0  # kept out of pretraining for the drafter's data (corpus.drafter_only_every)


def token_stream(tokenizer, docs: list[str]) -> torch.Tensor:
    """Documents joined by <|endoftext|> -> [N] long."""
    eot = tokenizer.convert_tokens_to_ids(ENDOFTEXT)
    ids: list[int] = []
    for enc in tokenizer(docs, add_special_tokens=False)["input_ids"]:
        ids.extend(enc)
        ids.append(eot)
    return torch.tensor(ids, dtype=torch.long)


def build_model(cfg: TargetCfg, tokenizer):
    """A Qwen3, or (target.family=qwen3_5) a Qwen3.5 hybrid of the same width: Gated DeltaNet layers with as many
    value heads as attention heads and as many key heads as KV heads, every fourth layer full attention."""
    from transformers import AutoConfig, AutoModelForCausalLM

    head_dim = cfg.hidden_size // cfg.num_heads
    fields = dict(vocab_size=len(tokenizer), hidden_size=cfg.hidden_size, intermediate_size=cfg.intermediate_size,
                  num_hidden_layers=cfg.num_layers, num_attention_heads=cfg.num_heads,
                  num_key_value_heads=cfg.num_kv_heads, head_dim=head_dim,
                  max_position_embeddings=cfg.max_position_embeddings, tie_word_embeddings=cfg.tie_word_embeddings,
                  eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id, bos_token_id=None)
    if cfg.family == "qwen3_5":
        fields.update(linear_num_value_heads=cfg.num_heads, linear_num_key_heads=cfg.num_kv_heads,
                      linear_key_head_dim=head_dim, linear_value_head_dim=head_dim, linear_conv_kernel_dim=4,
                      layer_types=["full_attention" if (i + 1) % 4 == 0 else "linear_attention"
                                   for i in range(cfg.num_layers)])
    return AutoModelForCausalLM.from_config(AutoConfig.for_model(
        "qwen3_5_text" if cfg.family == "qwen3_5" else "qwen3", **fields))


def lr_at(step: int, progress: float, cfg: PretrainCfg) -> float:
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    cos = 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))
    return cfg.lr * (cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * cos)


def _windows(stream: torch.Tensor, rows: int, seq_len: int, gen: torch.Generator) -> torch.Tensor:
    """[rows, seq_len + 1] random windows (offsets drawn on the CPU generator: deterministic per seed)."""
    starts = torch.randint(0, stream.numel() - seq_len - 1, (rows,), generator=gen)
    return stream[(starts[:, None] + torch.arange(seq_len + 1)).to(stream.device)]


def _loss(model, window: torch.Tensor, device: torch.device) -> torch.Tensor:
    with torch.autocast("cuda", dtype=torch.bfloat16, enabled=device.type == "cuda"):
        logits = model(input_ids=window[:, :-1]).logits
    return F.cross_entropy(logits.float().flatten(0, 1), window[:, 1:].flatten())


def train_lm(model, stream: torch.Tensor, cfg: PretrainCfg, device: torch.device, seed: int,
             log=print) -> tuple[int, float, str]:
    """-> (steps done, last logged loss, "steps" | "budget"). Syncs (.item()) only every cfg.log_every steps."""
    gen = torch.Generator().manual_seed(seed)
    on_cuda = device.type == "cuda"
    decay = [p for p in model.parameters() if p.dim() >= 2]
    other = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": cfg.weight_decay}, {"params": other, "weight_decay": 0}],
                            lr=cfg.lr, betas=(0.9, 0.95), fused=on_cuda)
    step_fn = torch.compile(model) if cfg.compile else model
    model.train()
    t0, last, stopped_by, step = time.perf_counter(), float("nan"), "steps", 0
    while step < cfg.steps:
        progress = max(step / cfg.steps, (time.perf_counter() - t0) / cfg.budget_s)
        if progress >= 1.0:
            stopped_by = "budget"
            break
        for group in opt.param_groups:
            group["lr"] = lr_at(step, progress, cfg)
        loss = _loss(step_fn, _windows(stream, cfg.rows, cfg.seq_len, gen), device)
        loss.backward()
        if cfg.clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        step += 1
        if step % cfg.log_every == 0 or step == cfg.steps:
            last = loss.item()  # SYNC: log cadence only
            dt = time.perf_counter() - t0
            log(f"pretrain step {step}/{cfg.steps} loss {last:.3f} "
                f"tok/s {step * cfg.rows * cfg.seq_len / dt:,.0f} elapsed {dt:.1f}s")
    model.eval()
    return step, last, stopped_by


@torch.no_grad()
def heldout_loss(model, stream: torch.Tensor, cfg: PretrainCfg, device: torch.device, batches: int = 4) -> float:
    if stream.numel() <= cfg.seq_len + 1:
        return float("nan")
    gen = torch.Generator().manual_seed(1234)
    losses = [_loss(model, _windows(stream, cfg.rows, cfg.seq_len, gen), device) for _ in range(batches)]
    return float(torch.stack(losses).mean())


def make_target(out_dir: Path, q: QualityCfg, device: torch.device, log=print) -> PretrainResult:
    """Corpus -> tokenizer -> pretrained target -> `out_dir` (model + tokenizer + corpus.json)."""
    t0 = time.perf_counter()
    split = corpus_split(q.corpus)
    heldin, heldout = split.target, split.heldout
    drafter_only = len(split.seen) - len(heldin)
    docs = pretraining_documents(heldin, q.corpus)
    tokenizer = build_tokenizer(docs, q.corpus.vocab_size)
    stream = token_stream(tokenizer, docs).to(device)
    eval_stream = token_stream(tokenizer, [f.text for f in heldout]).to(device)
    log(f"pretrain corpus: {len(heldin)} held-in files ({stream.numel():,} tokens incl. chat units), "
        f"{len(heldout)} held-out files, {drafter_only} for the drafter alone; tokenizer {len(tokenizer)} tokens ({time.perf_counter() - t0:.1f}s)")
    torch.manual_seed(q.seed)
    model = build_model(q.target, tokenizer).to(device)
    params = sum(p.numel() for p in model.parameters())
    log(f"pretrain model: {model.config.model_type} {params / 1e6:.1f}M params "
        f"({q.target.num_layers} layers, hidden {q.target.hidden_size})")
    steps, last, stopped_by = train_lm(model, stream, q.pretrain, device, q.seed, log)
    held = heldout_loss(model, eval_stream, q.pretrain, device)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    result = PretrainResult(path=str(out_dir), params=params, files_heldin=len(heldin), files_heldout=len(heldout),
                            files_drafter_only=drafter_only,
                            corpus_tokens=int(stream.numel()), steps=steps,
                            tokens_seen=steps * q.pretrain.rows * q.pretrain.seq_len, final_loss=round(last, 4),
                            heldout_loss=round(held, 4), seconds=round(time.perf_counter() - t0, 1),
                            stopped_by=stopped_by)
    (out_dir / "corpus.json").write_text(json.dumps({**asdict(result), "root": str(corpus_root(q.corpus)),
                                                     "heldout_files": [f.rel for f in heldout]}, indent=1) + "\n")
    log(f"pretrain done: {steps} steps, loss {last:.3f}, held-out loss {held:.3f}, {result.seconds}s ({stopped_by})")
    return result
