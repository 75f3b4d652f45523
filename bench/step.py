"""Training-step benchmark: `python -m bench.step --shape small --modes eager,compile,graph,compile+graph`.

Run from the repository root. What runs: the trainer's own modules, built as `trainer train` builds them -- an HF
target of the named shape (`transformers.AutoModelForCausalLM`, random init from `bench/shapes.py`; or `--target DIR` through
`load_target`), bf16 on CUDA, frozen, truncated after its last tap, with the doc-causal flex attention path on CUDA;
the trainer's `Drafter` (5 layers, KV injection, fp32 params under bf16 autocast), its chunked LM-head loss, AdamW
with a device LR; driven by `trainer.build.make_runner`. Data: synthetic `StaticBatch`es built by trainer.data
(random ids, `docs` packed documents per row (3), `anchors` sorted anchors per row).

One step = `accum` micro-steps of `batch` rows x `seq` tokens (target features, no grad; drafter forward + backward)
+ grad clip + AdamW. Each mode runs in its own subprocess (fresh allocator and peak counters; a crash loses one mode):
  eager          the eager stepper (flex_attention itself is always compiled: its eager form materializes the
                 scores)
  compile        trainer.step.policy.compile_step: drafter layers, target layers and the CE chunk torch.compile'd
                 (default mode, no CUDA graphs), then the eager stepper; also runs on CPU (Inductor C++)
  graph          the captured stepper: the whole step (target features, fwd/bwd of every micro-step, clip, AdamW) as
                 one StepGraph (CUDA only)
  compile+graph  compiled kernels inside the same capture (CUDA only)
--inductor KEY=VALUE,... sets torch._inductor.config in each mode's process before it compiles: a compiler setting
measured before the trainer adopts it. --pipeline 1 runs the steps through the trainer's threaded pipeline
(trainer.pipeline.train_pipe: loader -> target producer -> event ring -> drafter consumer), timed by the consumer's
events. Under torchrun
(`torchrun --nproc-per-node 2 -m bench.step ...`) every rank trains a replica on its own data and gradients are
averaged by trainer.distributed.make_grad_sync between the fwd/bwd and update graphs; figures are per GPU, rank 0
prints.

--drafter dflash2 builds a DFlash2 drafter at the same dims (its convolution and selector at their defaults,
docs/dflash2.md; the selector term at its full weight, as after its ramp); --optim muon steps Muon on the drafter's 2-D
weights and AdamW on the rest (docs/training.md "Optimizer"). The line above the table names both, as built.

Timing: CUDA events around every step, read once at the end (no host sync in the loop; host launch gaps count);
on CPU the host clock. Reported: median step time and its min-max over the timed steps (after warm-up or capture
and 2 untimed steps). tokens/s = accum * batch * seq / median.
MFU = useful FLOPs per step / median step time / 989 TFLOP/s (H200 SXM dense bf16, datasheet); the FLOPs formula is
in bench/shapes.py and takes its dims from the HF config and the DrafterConfig. It leaves out a DFlash2 drafter's
convolutions and selector, so the FLOPs of both drafters at the same dims are equal: compare them by tokens/s.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from dataclasses import asdict, dataclass

MODES = ("eager", "compile", "graph", "compile+graph")
ATTNS = ("auto", "flex", "sdpa")
DRAFTERS = ("dflash", "dflash2")  # --drafter -> model.drafter (DFlash2's fields at their defaults: docs/dflash2.md)
OPTIMS = ("adamw", "muon")  # --optim -> optim.name
HEAD_FP8 = {"auto": "auto", "1": True, "0": False}  # --head-fp8 -> step.head_fp8


@dataclass(frozen=True)
class BenchConfig:
    shape: str = "small"
    target: str = ""  # a local HF model directory (loaded through trainer.model.target.load_target); "" = --shape
    draft_layers: int = 5  # drafter layers = target taps
    batch: int = 4
    seq: int = 3072
    anchors: int = 512
    docs: int = 3  # documents per row (random lengths filling it exactly): 1 is the longest context per anchor
    block: int = 16
    accum: int = 1
    steps: int = 30
    warmup: int = 3
    attn: str = "auto"  # the drafter's block attention: auto = flex on CUDA, sdpa on CPU
    interval: int = 5
    ce_chunk: int = 4096
    ce: str = "auto"  # step.ce: the CE chunk kernel (auto, torch, triton)
    target_fp8: int = 0  # 1: model.target_fp8 (the target's decoder linears in FP8; Hopper)
    head_fp8: str = "auto"  # step.head_fp8: auto (the trainer's default), 1 (on or refuse) or 0 (off)
    profile: int = 0  # >0: after timing, profile this many steps and print the top kernels (PROF lines; CUDA)
    pipeline: int = 0  # 1: run the steps through the loader/producer/consumer threads (CUDA)
    inductor: str = ""  # KEY=VALUE,...: torch._inductor.config settings for each mode's process (experiments)
    drafter: str = "dflash"  # model.drafter: dflash | dflash2
    optim: str = "adamw"  # optim.name: adamw | muon

    def check(self) -> None:
        """Raise SystemExit with one line naming the fix."""
        from bench.shapes import check_shape

        from trainer.config import CE_KERNELS

        if self.attn not in ATTNS:
            raise SystemExit(f"unknown --attn {self.attn!r}; choose one of {list(ATTNS)}")
        if self.ce not in CE_KERNELS:
            raise SystemExit(f"unknown --ce {self.ce!r}; choose one of {list(CE_KERNELS)}")
        if self.drafter not in DRAFTERS:
            raise SystemExit(f"unknown --drafter {self.drafter!r}; choose one of {list(DRAFTERS)}")
        if self.optim not in OPTIMS:
            raise SystemExit(f"unknown --optim {self.optim!r}; choose one of {list(OPTIMS)}")
        if self.head_fp8 not in HEAD_FP8:
            raise SystemExit(f"unknown --head-fp8 {self.head_fp8!r}; choose one of {list(HEAD_FP8)}")
        if self.target and not os.path.isfile(os.path.join(self.target, "config.json")):
            raise SystemExit(f"--target {self.target}: no config.json there (a local Hugging Face model directory)")
        if not self.target:
            check_shape(self.shape)
        counts = ("draft_layers", "batch", "seq", "anchors", "docs", "accum", "steps", "interval", "ce_chunk")
        low = [name for name in counts if getattr(self, name) < 1]
        if low:
            raise SystemExit(f"--{low[0].replace('_', '-')} must be >= 1")
        if self.pipeline and self.steps < 2:
            raise SystemExit("--pipeline 1 needs --steps >= 2 (its step times are gaps between step ends)")
        if self.block < 2:
            raise SystemExit("--block must be >= 2")
        if self.anchors > self.seq - self.docs:  # a document of L tokens holds L - 1 anchor candidates
            raise SystemExit("--anchors must be <= --seq - --docs (every anchor needs a candidate position)")
        if self.inductor:
            check_inductor(inductor_settings(self.inductor))
        if self.drafter == "dflash2":
            self.check_dflash2()

    def check_dflash2(self) -> None:
        """DFlash2's default convolution groups and selector top-k against the target's width and vocabulary: the
        trainer's own check (trainer.targetdir.check_drafter_fits), before any build."""
        from bench.shapes import SHAPES

        from trainer.config import ModelCfg
        from trainer.errors import ConfigError
        from trainer.targetdir import TargetShape, check_drafter_fits, read_shape

        try:
            model = ModelCfg(drafter="dflash2", block_size=self.block, num_draft_layers=self.draft_layers)
            named = SHAPES.get(self.shape, {})
            shape = read_shape(self.target) if self.target else TargetShape(
                num_layers=None, hidden_size=named["hidden_size"], vocab_size=named["vocab_size"])
            check_drafter_fits(shape, model)
        except ConfigError as e:
            raise SystemExit(f"--drafter dflash2: {e}") from None

    @property
    def step_head_fp8(self) -> bool | str:
        """--head-fp8 as the trainer's step.head_fp8 (what bench/step_run.py builds the step with)."""
        return HEAD_FP8[self.head_fp8]


HELP = {
    "shape": "named target shape",
    "target": "a local HF model directory instead of --shape",
    "draft_layers": "drafter layers (= target taps)",
    "batch": "rows per micro-step",
    "seq": "tokens per row",
    "anchors": "anchors (16-token blocks) per row",
    "docs": "documents per row, of random lengths that fill it (1: one document per row)",
    "block": "block size",
    "accum": "micro-steps per optimizer step",
    "steps": "timed optimizer steps",
    "warmup": "warm-up steps before capture / timing",
    "attn": "the drafter's block attention: auto (flex on CUDA, sdpa on CPU), flex, sdpa",
    "interval": "steps between MEM lines",
    "ce_chunk": "positions per LM-head / cross-entropy chunk",
    "ce": "the CE chunk kernel (step.ce): auto, torch, triton",
    "target_fp8": "1: the target's decoder-layer linears in FP8 (model.target_fp8; CUDA, Hopper)",
    "head_fp8": "the LM head's logits and input-gradient GEMMs in FP8 (step.head_fp8): auto = on in the compile "
                "and graph modes where FP8 tensor cores run it, as the trainer; 1 = on or refuse; 0 = off",
    "profile": "after timing, profile this many steps and print the top kernels (PROF lines; CUDA)",
    "pipeline": "1: run the steps through the loader / producer / consumer threads (CUDA)",
    "inductor": "comma list of torch._inductor.config KEY=VALUE set in each mode's process before it compiles, to "
                "measure a compiler setting the trainer does not use (e.g. coordinate_descent_tuning=True)",
    "drafter": "the drafter's architecture (model.drafter): dflash, or dflash2 with its default convolution and "
               "selector (docs/dflash2.md)",
    "optim": "the optimizer (optim.name): adamw, or muon on the drafter's 2-D weights and AdamW on the rest",
}


def inductor_settings(spec: str) -> dict[str, object]:
    """Pure: "a.b=1,c=True,d=ATEN,TRITON" -> {"a.b": 1, "c": True, "d": "ATEN,TRITON"}: a comma starts a new item
    only before KEY=; a value is a Python literal, else the bare text. SystemExit naming an item that is not
    KEY=VALUE."""
    import ast
    import re

    settings: dict[str, object] = {}
    for item in filter(None, (part.strip() for part in re.split(r",(?=\s*(?:,|$|[\w.]+\s*=))", spec))):
        key, eq, text = item.partition("=")
        if not eq or not re.fullmatch(r"[\w.]+", key.strip()) or not text.strip():
            raise SystemExit(f"--inductor {item!r}: expected KEY=VALUE")
        try:
            value = ast.literal_eval(text.strip())
        except Exception:  # not a literal (a bare word, or a literal ast refuses): the text itself
            value = text.strip()
        settings[key.strip()] = value
    return settings


def check_inductor(settings: dict[str, object]) -> None:
    """SystemExit naming the first key torch._inductor.config does not have, or the first value whose type is not
    its default's (the config module checks none: `flag=false` would store the truthy string "false")."""
    import torch._inductor.config as inductor_config

    known = inductor_config.get_config_copy()
    for key, value in settings.items():
        if key not in known:
            raise SystemExit(f"--inductor: torch._inductor.config has no {key!r}")
        default = known[key]
        fits = (default is None or value is None or type(value) is type(default)
                or (type(default) is float and type(value) is int))
        if not fits:
            raise SystemExit(f"--inductor {key}={value!r}: expected a {type(default).__name__} like its default "
                             f"{default!r}")


def set_inductor(settings: dict[str, object]) -> None:
    """Apply checked settings (dotted keys reach the sub-configs, e.g. triton.multi_kernel)."""
    import torch._inductor.config as inductor_config

    for key, value in settings.items():
        *path, last = key.split(".")
        target = inductor_config
        for part in path:
            target = getattr(target, part)
        setattr(target, last, value)


def parse(argv: list[str]) -> tuple[BenchConfig, list[str], str | None]:
    from bench.shapes import SHAPES

    p = argparse.ArgumentParser(prog="python -m bench.step", description=__doc__.split("\n\n")[0])
    helps = dict(HELP, shape=f"{HELP['shape']}: {', '.join(SHAPES)}")
    for field, default in asdict(BenchConfig()).items():
        p.add_argument("--" + field.replace("_", "-"), type=type(default), default=default,
                       help=f"{helps[field]} (default: {default!r})")
    p.add_argument("--modes", default=",".join(MODES), help=f"comma list of {', '.join(MODES)} (default: all)")
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    a = vars(p.parse_args(argv))
    modes, child = a.pop("modes").split(","), a.pop("child")
    bad = [m for m in modes if m not in MODES]
    if bad:
        raise SystemExit(f"unknown mode(s) {bad}; choose from {list(MODES)}")
    cfg = BenchConfig(**a)
    cfg.check()
    return cfg, modes, child


def cpu_refusal(cfg: BenchConfig, cuda: bool) -> str | None:
    """Pure: why this bench cannot run here, or None. On a CPU only the `tiny` shape (or a --target DIR) finishes:
    the others take minutes per step there and tell nothing about the GPU step they model."""
    if cuda or cfg.target or cfg.shape == "tiny":
        return None
    return (f"--shape {cfg.shape} is a GPU shape and this machine has no CUDA GPU; on a CPU use --shape tiny "
            f"(or --target DIR)")


def run_child(cfg: BenchConfig, mode: str) -> int:
    """One mode in this process: BENCH_RESULT <json> on success; BENCH_ERROR <one line> (exit 2) for a refusal."""
    from trainer.errors import TrainerError

    try:
        from bench.step_run import run_mode

        set_inductor(inductor_settings(cfg.inductor))
        result = run_mode(cfg, mode)
    except TrainerError as e:
        print(f"BENCH_ERROR {e}", flush=True)
        return 2
    print("BENCH_RESULT " + json.dumps(result), flush=True)
    return 0


def outcome(mode: str, returncode: int, stdout: str, stderr: str) -> dict:
    """Pure: a child's output -> its result dict, or {"mode", "error"} with the refusal or the output's tail."""
    lines = stdout.splitlines()
    found = [line for line in lines if line.startswith("BENCH_RESULT ")]
    if returncode == 0 and found:
        return json.loads(found[-1][len("BENCH_RESULT "):])
    refused = [line[len("BENCH_ERROR "):] for line in lines if line.startswith("BENCH_ERROR ")]
    if refused:
        return {"mode": mode, "error": refused[-1]}
    tail = (stdout + stderr).strip().splitlines()[-8:]
    return {"mode": mode, "error": f"rc={returncode}: " + " | ".join(tail)[-600:]}


def headline(cfg: BenchConfig, results: list[dict]) -> str:
    """Pure: the line above the table: what was built (the drafter's architecture and the optimizer, as the first
    finished mode reports them; the flags where none finished) and the step's shape."""
    built = next((r for r in results if "error" not in r), {})
    return (f"drafter {built.get('drafter', cfg.drafter)}, optim {built.get('optim', cfg.optim)}, "
            f"shape {cfg.target or cfg.shape}, {cfg.accum} x {cfg.batch} rows x {cfg.seq} tokens per step")


def table(results: list[dict]) -> str:
    base = next((r for r in results if r.get("mode") == "eager" and "error" not in r), None)
    lines = [
        f"{'mode':14} {'tok/s/GPU':>10} {'step ms':>8} {'min-max ms':>13} {'MFU':>6} {'TFLOP/s':>8} "
        f"{'peak GiB':>8} {'rsvd GiB':>8} {'vs eager':>8}"
    ]
    for r in results:
        if "error" in r:
            lines.append(f"{r['mode']:14} FAILED: {r['error']}")
            continue
        # Without an eager row there is nothing to compare against: a dash, not "nanx".
        speed = f"{r['tokens_per_s_per_gpu'] / base['tokens_per_s_per_gpu']:7.2f}x" if base else f"{'-':>8}"
        lines.append(
            f"{r['mode']:14} {r['tokens_per_s_per_gpu']:10.0f} {r['step_s_median'] * 1e3:8.1f} "
            f"{r['step_s_min'] * 1e3:6.1f}-{r['step_s_max'] * 1e3:<6.1f} {r['mfu'] * 100:5.1f}% "
            f"{r['tflops_per_s']:8.1f} {r['peak_alloc_gib']:8.1f} {r['peak_reserved_gib']:8.1f} {speed}"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    cfg, modes, child = parse(argv)
    if child is not None:
        return run_child(cfg, child)
    if cfg.shape != "tiny" and not cfg.target:
        import torch

        refusal = cpu_refusal(cfg, torch.cuda.is_available())
        if refusal:
            raise SystemExit(refusal)
    main_rank = int(os.environ.get("RANK", "0")) == 0
    say = print if main_rank else (lambda *a, **k: None)
    say("config", json.dumps(asdict(cfg)), flush=True)
    results = []
    for mode in modes:
        cmd = [sys.executable, "-m", "bench.step", *argv, "--child", mode]
        proc = subprocess.run(cmd, capture_output=True, text=True, env=os.environ.copy())
        if main_rank:
            keep = ("MEM", "PROF")
            sys.stdout.write("".join(line + "\n" for line in proc.stdout.splitlines() if line.startswith(keep)))
        results.append(outcome(mode, proc.returncode, proc.stdout, proc.stderr))
        say("RESULT " + json.dumps(results[-1]), flush=True)
    say(headline(cfg, results), flush=True)
    say(table(results), flush=True)
    return 0 if all("error" not in r for r in results) else 1


if __name__ == "__main__":
    raise SystemExit(main())
