"""The trainer's command line grammar: every command, its flags and their --help. Pure: building it imports no torch.

`eval` takes a form (evalform.py): `eval run`, `eval export`, `eval prompts`. Each form's parser accepts every eval
flag but shows only its own; evalform.check_eval refuses the others in one line naming their form. The form-less
spelling (`eval --run-dir D`, ...) parses on `eval` itself, its flags hidden. Eval flags default to unset
(argparse.SUPPRESS), so a flag given before the form's name is kept rather than reset by the form's defaults.
"""
from __future__ import annotations

import argparse

from dflash_ops import wire


def _recipe_help() -> str:
    from trainer.config import PIPELINE_COMMAND, bundled_recipes

    kinds = bundled_recipes()
    train = ", ".join(n for n, k in kinds.items() if k == "train")
    pipeline = ", ".join(n for n, k in kinds.items() if k == "pipeline")
    text = f"a bundled trainer recipe ({train}) or a PATH.yaml"
    if pipeline:
        text += f"; {pipeline}: quality-pipeline recipes, for {PIPELINE_COMMAND}"
    return text


def build_parser() -> argparse.ArgumentParser:
    """`python -m trainer`'s parser; its parse leaves `command` (and, for eval, `form`: None in the form-less
    spelling) on the namespace."""
    from trainer.config import user_path
    from trainer.rundir import RESUME_MAY_CHANGE, RESUME_MAY_MOVE

    p = argparse.ArgumentParser(prog="python -m trainer", description="DFlash drafter trainer")
    sub = p.add_subparsers(dest="command", required=True)
    t = sub.add_parser("train", help="train a drafter")
    t.add_argument("--recipe", default=None,
                   help="required unless --resume (which reads the run's config.json, and the recipe only where the "
                        "run directory holds none): " + _recipe_help())
    t.add_argument("--run-dir", type=user_path, default=None,
                   help="run directory (default: runs/<recipe>-<utc time>)")
    t.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override one config leaf, e.g. --set optim.lr=3e-4 (repeatable)")
    t.add_argument("--resume", action="store_true",
                   help="continue from the newest checkpoint in --run-dir, with the config.json it started with "
                        f"(--set may change only {', '.join(RESUME_MAY_CHANGE)}; and {', '.join(RESUME_MAY_MOVE)} "
                        "where the target or the data moved: the same weights and file sizes are checked, and "
                        "config.json then names the new places)")
    t.epilog = (f"SIGTERM or Ctrl-C stops a run at its next log step with a checkpoint, prints "
                f"{wire.STOPPED_PREFIX.strip()} and the resume command, and exits {wire.EXIT_TERMINATED} / "
                f"{wire.EXIT_INTERRUPTED}; a second Ctrl-C ends it at once (a second SIGTERM is ignored).")
    _eval_parser(sub)
    _regenerate_parser(sub)
    x = sub.add_parser("export", help="(re)write <run-dir>/export from the newest checkpoint")
    x.add_argument("--run-dir", type=user_path, required=True)
    x.add_argument("--target", type=user_path, default=None,
                   help="the run's target where it is now, if it moved since the run (default: the run's model.target;"
                        " its weights and config.json are checked against the run's)")
    m = sub.add_parser("make-tiny-target", help="build and save a tiny Qwen3 or Llama 3 target + tokenizer",
                       description="A target + tokenizer (with a chat template) built offline: by default the tiny "
                                   "Qwen3 the tests use, briefly trained on the bundled chat data; --family llama: "
                                   "a Llama 3 of the same size (or of --hidden / --layers).")
    m.add_argument("out_dir", help="a new or empty directory (one holding anything is refused)")
    m.add_argument("--family", default="qwen3", choices=("qwen3", "llama"), help="(default: %(default)s)")
    m.add_argument("--hidden", type=int, default=64, help="hidden size (default: %(default)s)")
    m.add_argument("--layers", type=int, default=6, help="decoder layers (default: %(default)s)")
    m.add_argument("--train-steps", type=int, default=100,
                   help="steps on the bundled chat data; 0 keeps the random weights (default: %(default)s)")
    return p


def _regenerate_parser(sub) -> None:
    from trainer.config import DTYPES, user_path
    from trainer.regen.plan import ENGINES
    from trainer.regen.rows import THINKING_MODES

    r = sub.add_parser("regenerate", help="answer prompt files with the target: the drafter's training data",
                       description="Answer every prompt of the prompt files with the target itself, into a training "
                                   "JSONL of token lines (the target's exact tokens, loss on the answer) and a "
                                   "FILE.meta.json of what made them and their counts (answered, failed, skipped). "
                                   "A restarted job with the same --out continues where it stopped. Formats: chat (conversations / messages), ShareGPT, GSM8K, "
                                   "MATH-500, HumanEval, MBPP, MT-Bench, Alpaca, {\"prompt\": ...}, plain text lines; a "
                                   "conversation is answered after its last user turn.")
    r.add_argument("--target", type=user_path, required=True, help="the target's local Hugging Face directory")
    r.add_argument("--prompts", type=user_path, required=True, nargs="+", metavar="FILE", help="prompt files")
    r.add_argument("--out", type=user_path, required=True,
                   help="the training JSONL to write (appended to when it is resumed)")
    r.add_argument("--max-new", type=int, default=512,
                   help="new tokens per answer at most, up to the target's context less the prompt (default: "
                        "%(default)s)")
    r.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default: %(default)s)")
    r.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling (default: %(default)s)")
    r.add_argument("--seed", type=int, default=0, help="sampling seed (default: %(default)s)")
    r.add_argument("--continuations", type=int, default=1, metavar="N",
                   help="answers per prompt; N > 1 needs --temperature > 0 (default: %(default)s)")
    r.add_argument("--batch", type=int, default=64, help="prompts generated together (default: %(default)s)")
    r.add_argument("--limit", type=int, default=0, help="the first N distinct prompts only (default: all)")
    r.add_argument("--enable-thinking", choices=("on", "off"), default=None,
                   help="the chat template's enable_thinking (serve the drafter the same way)")
    r.add_argument("--chat-template-kwargs", default=None, metavar="JSON",
                   help="""keyword arguments for the chat template, e.g. '{"enable_thinking": false}'""")
    r.add_argument("--system", default=None, help="a system turn for the prompts that have none")
    r.add_argument("--engine", default="static", choices=ENGINES,
                   help="static: static cache, one CUDA graph replay per token (falls back to hf, with a note, "
                        "where it cannot serve the target); hf: HF generate (default: %(default)s)")
    r.add_argument("--dtype", default="auto", choices=DTYPES,
                   help="the target's dtype (default: bf16 on CUDA, fp32 on CPU)")
    r.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:N (default: %(default)s)")
    r.add_argument("--max-bad-fraction", type=float, default=0.01,
                   help="malformed prompt lines tolerated, as for training data (default: %(default)s)")
    r.add_argument("--thinking", default="keep", choices=THINKING_MODES,
                   help="a chat template's reasoning segment (<think>...</think>) in the training rows: keep it (the "
                        "drafter learns to draft what the target writes when served with thinking on) or drop it "
                        "(default: %(default)s)")
    r.add_argument("--drop-truncated", action="store_true",
                   help="leave answers that reach --max-new without a stop id out of the training data (they go to "
                        "OUT.skipped.jsonl, counted in OUT.meta.json); without it they are kept and marked truncated")
    r.add_argument("--memory-gib", type=float, default=0.0, metavar="G",
                   help="the memory the job may plan for: weights + --batch x (longest prompt + --max-new) of cache "
                        "must fit, else exit 2 naming a --batch that does (default: the GPU's free memory; on CPU "
                        "no check)")
    r.add_argument("--target-fp8", action="store_true",
                   help="the target's decoder-layer linears in FP8 (e4m3 weights, per-channel weight and per-token "
                        "activation scales), as a server run with FP8 quantization: the answers are the FP8 target's, "
                        "close to but not equal to the bf16 target's; CUDA compute capability 9.0+ (refused elsewhere "
                        "before any weight loads)")


def _eval_parser(sub) -> None:
    from trainer.cli.evalform import FORMS

    e = sub.add_parser("eval", help="simulated tau on held-out data, or real decoding on prompt files",
                       description="eval run: simulated tau on a run's held-out split. eval export: simulated tau "
                                   "of an exported drafter on a training-format JSONL. eval prompts: real batch-1 "
                                   "speculative decoding of prompt files. `eval FORM --help` lists a form's flags. "
                                   "The form-less spelling names the same forms by their flags: eval --run-dir D | "
                                   "--drafter EXPORT_DIR --target T --data F | --drafter EXPORT_DIR --target T "
                                   "--prompts FILE...")
    _eval_flags(e, own=())
    forms = e.add_subparsers(dest="form", metavar="{" + ",".join(FORMS) + "}")
    r = forms.add_parser("run", usage="%(prog)s --run-dir D",
                         help="simulated tau of a run's export on the run's held-out rows",
                         description="Simulated tau of the run's own export, against the run's own target, on the "
                                     "run's held-out split (data.eval_paths or data.eval_fraction).")
    _eval_flags(r, own=("--run-dir",))
    x = forms.add_parser("export", usage="%(prog)s --drafter EXPORT_DIR --target T --data F [--max-bad-fraction F]",
                         help="simulated tau of an exported drafter on a training-format JSONL",
                         description="Simulated tau of an exported drafter, against a target, on every line of a "
                                     "training-format JSONL.")
    _eval_flags(x, own=("--drafter", "--target", "--data", "--max-bad-fraction"))
    p = forms.add_parser("prompts", usage="%(prog)s --drafter EXPORT_DIR --target T --prompts FILE... [--limit N] "
                                          "[--max-new N] [--engine E] [--target-dtype DTYPE]",
                         help="real batch-1 speculative decoding of prompt files",
                         description="Real batch-1 speculative decoding of each prompt file (GSM8K, MATH-500, "
                                     "HumanEval, MBPP, MT-Bench, chat, ShareGPT or plain lines): tau, acceptance per "
                                     "position, speedup over the target alone, per file.")
    _eval_flags(p, own=("--drafter", "--target", "--prompts", "--limit", "--max-new", "--engine", "--target-dtype"))


def _eval_flags(p: argparse.ArgumentParser, own: tuple[str, ...]) -> None:
    """Every eval flag on `p`, unset unless given; those not in `own` hidden from its --help."""
    from trainer.cli.evalform import PROMPT_DEFAULTS as D
    from trainer.config import DTYPES, DataCfg, user_path

    def add(flag: str, help: str, **kw) -> None:
        p.add_argument(flag, default=argparse.SUPPRESS, help=help if flag in own else argparse.SUPPRESS, **kw)

    add("--run-dir", "the run directory", type=user_path, metavar="D")
    add("--drafter", "the drafter's export directory (config.json + model.safetensors)", type=user_path,
        metavar="EXPORT_DIR")
    add("--target", "the target's Hugging Face directory", type=user_path, metavar="T")
    add("--data", "a training-format JSONL", type=user_path, metavar="F")
    add("--max-bad-fraction", f"malformed lines tolerated, a fraction in [0, 1] (default: the training data's, "
                              f"{DataCfg().max_bad_fraction})", type=float, metavar="F")
    add("--prompts", "prompt files", type=user_path, nargs="+", metavar="FILE")
    add("--limit", f"prompts per file (default: {D['limit']})", type=int, metavar="N")
    add("--max-new", f"new tokens per prompt at most, 2 or more (default: {D['max_new']})", type=int, metavar="N")
    add("--engine", f"static: static caches, CUDA-graph replays; hf: the HF-cache reference (default: {D['engine']})",
        choices=("static", "hf"))
    add("--target-dtype", "the target's dtype while decoding (default: bf16 on CUDA, fp32 on CPU)", choices=DTYPES)
