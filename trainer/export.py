"""Export the drafter in the form DFlash serving stacks load: `config.json` (DFlash fields) + `model.safetensors`.

Only drafter weights are written (the serving side reuses the target's embedding and LM head). Names follow z-lab's
`DFlashDraftModel` (`layers.{i}.self_attn.q_proj.weight`, `fc.weight`, `hidden_norm.weight`, `norm.weight`, ...).
Written to a temp dir and renamed, like checkpoints.
"""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import torch

from trainer.model.drafter import Drafter, DrafterConfig


def export_config(cfg: DrafterConfig, *, block_size: int, layer_ids: tuple[int, ...], num_target_layers: int,
                  mask_token_id: int, vocab_size: int, max_position_embeddings: int, dtype: str) -> dict:
    return {
        "architectures": ["DFlashDraftModel"],
        "model_type": "qwen3",
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": cfg.num_key_value_heads,
        "head_dim": cfg.head_dim,
        "num_hidden_layers": cfg.num_layers,
        "hidden_act": "silu",
        "attention_bias": cfg.attention_bias,
        "rms_norm_eps": cfg.rms_norm_eps,
        "rope_theta": cfg.rope_theta,
        "max_position_embeddings": max_position_embeddings,
        "vocab_size": vocab_size,
        "tie_word_embeddings": False,
        "torch_dtype": dtype,
        "block_size": block_size,
        "num_target_layers": num_target_layers,
        "dflash_config": {"mask_token_id": mask_token_id, "target_layer_ids": list(layer_ids), "block_size": block_size},
    }


def export_drafter(out_dir: Path, drafter: Drafter, config: dict, dtype: torch.dtype = torch.bfloat16) -> Path:
    from safetensors.torch import save_file

    out_dir = Path(out_dir)
    tmp = out_dir.with_name(out_dir.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    tensors = {k: v.detach().to("cpu", dtype).contiguous() for k, v in drafter.state_dict().items()}
    save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
    (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    if out_dir.exists():
        shutil.rmtree(out_dir)
    os.replace(tmp, out_dir)
    return out_dir


def load_exported(export_dir: Path, device: torch.device | str = "cpu", backend: str = "sdpa") -> tuple[Drafter, dict]:
    """Rebuild a Drafter (fp32) from an export dir -> (drafter, config dict)."""
    from safetensors.torch import load_file

    export_dir = Path(export_dir)
    config = json.loads((export_dir / "config.json").read_text())
    dcfg = DrafterConfig(
        hidden_size=config["hidden_size"], intermediate_size=config["intermediate_size"],
        num_attention_heads=config["num_attention_heads"], num_key_value_heads=config["num_key_value_heads"],
        head_dim=config["head_dim"], num_layers=config["num_hidden_layers"],
        num_taps=len(config["dflash_config"]["target_layer_ids"]), rms_norm_eps=config["rms_norm_eps"],
        rope_theta=config["rope_theta"], attention_bias=config.get("attention_bias", False))
    drafter = Drafter(dcfg, backend=backend)
    state = load_file(str(export_dir / "model.safetensors"))
    drafter.load_state_dict({k: v.float() for k, v in state.items()})
    return drafter.to(device).eval(), config
