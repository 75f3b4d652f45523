"""The drafter export, in the form DFlash serving stacks load: `config.json` (DFlash fields) + `model.safetensors`.

Only drafter weights are written (the serving side reuses the target's embedding and LM head). Names follow z-lab's
`DFlashDraftModel` (`layers.{i}.self_attn.q_proj.weight`, `fc.weight`, `hidden_norm.weight`, `norm.weight`, ...);
a DFlash2 drafter's are `DFlash2DraftModel`'s as SGLang and vLLM load it (docs/dflash2.md).
`ExportConfig` is the export's `config.json` as a value: written from a trained run, read back (by evaluation and
decoding) into the same value, so no caller indexes the JSON by hand. Written to a temp dir and renamed, like
checkpoints.
"""
from __future__ import annotations

import dataclasses
import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch

from trainer.errors import ConfigError
from trainer.model.drafter import Dflash2Config, Drafter, DrafterConfig

# The `dflash_config` fields a DFlash2 drafter adds, as SGLang's and vLLM's DFlash2 loaders read them (docs/dflash2.md).
DFLASH2_FIELDS = ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k")


@dataclass(frozen=True, kw_only=True)
class ExportConfig:
    drafter: DrafterConfig
    block_size: int
    target_layer_ids: tuple[int, ...]
    num_target_layers: int
    mask_token_id: int
    vocab_size: int
    max_position_embeddings: int
    dtype: str = "bfloat16"
    mask_token: str | None = None  # the mask's string, where the tokenizer has one (some SGLang versions resolve it)
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None
    pad_token_id: int | None = None

    @staticmethod
    def of(drafter: DrafterConfig, target, block_size: int) -> "ExportConfig":
        """The export of a drafter trained against `target` (a `trainer.model.target.Target`)."""
        hf, tok = target.hf_config, target.tokenizer
        mask_token = None
        if tok is not None and target.mask_token_id < len(tok):
            mask_token = tok.convert_ids_to_tokens(target.mask_token_id)
        return ExportConfig(drafter=drafter, block_size=block_size, target_layer_ids=tuple(target.layer_ids),
                            num_target_layers=target.num_layers, mask_token_id=target.mask_token_id,
                            vocab_size=target.embed_tokens.weight.shape[0],
                            max_position_embeddings=getattr(hf, "max_position_embeddings", 32768),
                            mask_token=mask_token, bos_token_id=getattr(hf, "bos_token_id", None),
                            eos_token_id=getattr(hf, "eos_token_id", None), pad_token_id=getattr(hf, "pad_token_id",
                                                                                                  None))

    def to_json(self) -> dict:
        """What SGLang's, vLLM's and SpecForge's DFlash loaders read: a Qwen3-shaped config with its `layer_types`
        and sliding window, RoPE in the legacy (`rope_theta`, `rope_scaling`) and the transformers-5
        (`rope_parameters`) form, and `dflash_config`. A DFlash2 drafter: `DFlash2DraftModel` and its
        `dflash_config` fields (`dflash2_fields`)."""
        d = self.drafter
        dflash = {"mask_token_id": self.mask_token_id, "target_layer_ids": list(self.target_layer_ids),
                  "block_size": self.block_size, "num_target_layers": self.num_target_layers}
        if self.mask_token is not None:
            dflash["mask_token"] = self.mask_token
        if d.dflash2 is not None:
            dflash.update(dflash2_fields(d.dflash2))
        return {
            "architectures": ["DFlashDraftModel" if d.dflash2 is None else "DFlash2DraftModel"],
            "model_type": "qwen3",
            "hidden_size": d.hidden_size,
            "intermediate_size": d.intermediate_size,
            "num_attention_heads": d.num_attention_heads,
            "num_key_value_heads": d.num_key_value_heads,
            "head_dim": d.head_dim,
            "num_hidden_layers": d.num_layers,
            "layer_types": [d.kind(i) for i in range(d.num_layers)],
            "use_sliding_window": d.window is not None,
            "sliding_window": d.window,
            "max_window_layers": d.num_layers,
            "hidden_act": "silu",
            "attention_bias": d.attention_bias,
            "attention_dropout": 0.0,
            "rms_norm_eps": d.rms_norm_eps,
            "rope_theta": d.rope_theta,
            "rope_scaling": None,
            "rope_parameters": {"rope_type": "default", "rope_theta": d.rope_theta},
            "max_position_embeddings": self.max_position_embeddings,
            "vocab_size": self.vocab_size,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": self.eos_token_id,
            "pad_token_id": self.pad_token_id,
            "tie_word_embeddings": False,
            "torch_dtype": self.dtype,
            "block_size": self.block_size,
            "num_target_layers": self.num_target_layers,
            "dflash_config": dflash,
        }

    @staticmethod
    def from_json(config: dict, source: str = "config.json") -> "ExportConfig":
        """Read a DFlash drafter's config.json -- ours, or one written by another tool (legacy or transformers-5
        RoPE fields, `layer_types`). A missing field, or what this drafter cannot honour (RoPE scaling, sliding-
        window layers), is one ConfigError naming it."""
        def refuse(what: str) -> ConfigError:
            return ConfigError(f"{source}: {what}", hint="this trainer's drafter has full or sliding-window "
                                                         "attention layers with plain RoPE; retrain or convert it")
        try:
            dflash = config["dflash_config"]
            layer_ids = tuple(int(i) for i in dflash["target_layer_ids"])
            theta, scaling = _rope_of(config)
            if scaling not in (None, "default"):
                raise refuse(f"RoPE scaling {scaling!r} is not supported")
            layers = int(config["num_hidden_layers"])
            layer_types = tuple(config.get("layer_types") or ())
            unknown = sorted(set(layer_types) - {"full_attention", "sliding_attention"})
            if unknown or (layer_types and len(layer_types) != layers):
                raise refuse(f"layer types {unknown or list(layer_types)} are not supported "
                             f"(full_attention or sliding_attention, one per layer)")
            window = config.get("sliding_window") if "sliding_attention" in layer_types else None
            if "sliding_attention" in layer_types and not (isinstance(window, int) and window >= 1):
                raise refuse(f"sliding-window layers with sliding_window={window!r}")
            drafter = DrafterConfig(
                hidden_size=config["hidden_size"], intermediate_size=config["intermediate_size"],
                num_attention_heads=config["num_attention_heads"], num_key_value_heads=config["num_key_value_heads"],
                head_dim=config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"],
                num_layers=layers, num_taps=len(layer_ids), rms_norm_eps=config["rms_norm_eps"], rope_theta=theta,
                attention_bias=config.get("attention_bias", False),
                layer_types=layer_types if "sliding_attention" in layer_types else (), sliding_window=window)
            block_size = int(dflash.get("block_size", config.get("block_size", 0)) or 0)
            if block_size < 2:
                raise refuse("no block_size (dflash_config.block_size or block_size)")
            if "DFlash2DraftModel" in (config.get("architectures") or ()):
                softcap = dflash.get("final_logit_softcapping")
                drafter = dataclasses.replace(drafter, dflash2=Dflash2Config(
                    block_size=block_size, vocab_size=int(config["vocab_size"]),
                    **{k: int(dflash[k]) for k in DFLASH2_FIELDS},
                    output_multiplier=float(dflash.get("output_multiplier", 1.0)),
                    final_logit_softcapping=float(softcap) if softcap else None))
            return ExportConfig(drafter=drafter, block_size=block_size, target_layer_ids=layer_ids,
                                num_target_layers=int(dflash.get("num_target_layers", config.get("num_target_layers",
                                                                                                  0)) or 0),
                                mask_token_id=int(dflash["mask_token_id"]), vocab_size=config["vocab_size"],
                                max_position_embeddings=config.get("max_position_embeddings", 32768),
                                dtype=config.get("torch_dtype") or config.get("dtype") or "bfloat16",
                                mask_token=dflash.get("mask_token"), bos_token_id=config.get("bos_token_id"),
                                eos_token_id=config.get("eos_token_id"), pad_token_id=config.get("pad_token_id"))
        except KeyError as e:
            raise ConfigError(f"{source}: a DFlash drafter config needs the field {e.args[0]!r}",
                              hint="point at a drafter export directory (config.json + model.safetensors)") from None


def dflash2_fields(d2: Dflash2Config) -> dict:
    """A DFlash2 drafter's `dflash_config` fields: its four structure fields, and the unary-logit transform where it
    is not the identity (the loaders default `output_multiplier` to 1 and no `final_logit_softcapping`)."""
    fields = {k: getattr(d2, k) for k in DFLASH2_FIELDS}
    if d2.output_multiplier != 1.0:
        fields["output_multiplier"] = d2.output_multiplier
    if d2.final_logit_softcapping is not None:
        fields["final_logit_softcapping"] = d2.final_logit_softcapping
    return fields


def _rope_of(config: dict) -> tuple[float, str | None]:
    """(theta, scaling type) from either RoPE form; transformers 5's `rope_parameters` wins where both exist."""
    params = config.get("rope_parameters")
    if isinstance(params, dict) and "rope_theta" in params:
        return float(params["rope_theta"]), params.get("rope_type") or params.get("type")
    legacy = config.get("rope_scaling")
    kind = (legacy.get("rope_type") or legacy.get("type")) if isinstance(legacy, dict) else None
    return float(config.get("rope_theta", 10000.0)), kind


def export_drafter(out_dir: Path, drafter: Drafter, config: ExportConfig, dtype: torch.dtype = torch.bfloat16) -> Path:
    from safetensors.torch import save_file

    out_dir = Path(out_dir)
    tmp = out_dir.with_name(out_dir.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    tensors = {k: v.detach().to("cpu", dtype).contiguous() for k, v in drafter.state_dict().items()}
    save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
    (tmp / "config.json").write_text(json.dumps(config.to_json(), indent=2) + "\n")
    # A server usually runs as another user: the files must be readable by it whatever the trainer's umask was.
    tmp.chmod(0o755)
    for f in tmp.iterdir():
        f.chmod(0o644)
    # The old export is moved aside, not deleted, until the new one is in place: a process killed between the two
    # renames leaves export.old, never no export at all.
    old = out_dir.with_name(out_dir.name + ".old")
    shutil.rmtree(old, ignore_errors=True)
    if out_dir.exists():
        os.replace(out_dir, old)
    os.replace(tmp, out_dir)
    shutil.rmtree(old, ignore_errors=True)
    return out_dir


def load_exported(export_dir: Path, device: torch.device | str = "cpu",
                  backend: str = "sdpa") -> tuple[Drafter, ExportConfig]:
    """Rebuild a Drafter (fp32) from an export dir -> (drafter, its ExportConfig). Weights cut short, not
    safetensors, or not those its config.json describes: one ConfigError naming the file."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    from trainer.rundir import read_export_config

    export_dir = Path(export_dir)
    config = ExportConfig.from_json(read_export_config(export_dir), str(export_dir / "config.json"))
    drafter = Drafter(config.drafter, backend=backend)
    weights = export_dir / "model.safetensors"
    hint = "export it again (python -m trainer export --run-dir RUN), or copy the whole export directory again"
    try:
        state = load_file(str(weights))
    except (SafetensorError, OSError) as e:
        raise ConfigError(f"{weights} cannot be read as safetensors (cut short or not one?): {e}", hint=hint) from None
    try:
        drafter.load_state_dict({k: v.float() for k, v in state.items()})
    except RuntimeError as e:  # missing or unexpected keys, other shapes: torch lists them, the first line says which
        detail = " ".join(str(e).split())[:300]
        raise ConfigError(f"{weights} does not hold the drafter its config.json describes: {detail}",
                          hint=hint) from None
    return drafter.to(device).eval(), config


def load_pair(export_dir: Path, target_dir: str | Path, device: torch.device | str, dtype: str = "auto",
              backend: str = "sdpa"):
    """An exported drafter (fp32; run under autocast on CUDA, as in training) and its full (untruncated) target in
    `dtype`, tapped as the export says -> (Target, Drafter, ExportConfig)."""
    from trainer.model.target import load_target

    drafter, ecfg = load_exported(export_dir, device, backend=backend)
    check_same_target(ecfg, export_dir, target_dir)
    target = load_target(target_dir, num_draft_layers=ecfg.drafter.num_layers, layer_ids=ecfg.target_layer_ids,
                         mask_token_id=ecfg.mask_token_id, device=device, dtype=dtype, truncate=False)
    return target, drafter, ecfg


def check_same_target(ecfg: ExportConfig, export_dir: Path, target_dir: str | Path) -> None:
    """The target's config.json against what the export recorded of the target it was trained on (layers, hidden
    size, vocabulary), before its weights load: another target would load, tapped at the export's layer ids, and
    give a tau near 1 or an index error deep in the first forward. An export that did not record a fact (another
    tool's: num_target_layers 0) is not checked on it."""
    from trainer.targetdir import TargetShape, read_shape

    have = read_shape(target_dir)
    want = TargetShape(num_layers=ecfg.num_target_layers or None, hidden_size=ecfg.drafter.hidden_size,
                       vocab_size=ecfg.vocab_size)
    pairs = zip((want.num_layers, want.hidden_size, want.vocab_size),
                (have.num_layers, have.hidden_size, have.vocab_size))
    if any(w is not None and h is not None and w != h for w, h in pairs):
        raise ConfigError(f"the drafter {export_dir} was trained on a target of {want.describe()}, but the target "
                          f"{target_dir} has {have.describe()}: evaluate it with the target it was trained on")
