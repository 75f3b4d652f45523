"""What a target directory says about itself, read from its files alone: no torch, no transformers import.

The commands that load a target (`regenerate`, `train`, and the family rule of `trainer.model.target`) refuse a
directory here, in one line, before torch is imported: no directory, no config.json or an unreadable one, a family
this trainer cannot serve (state-space or other linear mixers than Gated DeltaNet; a multimodal checkpoint other
than Qwen3.5's, whose language model transformers loads alone; a model_type the installed transformers has no
causal LM for; a quantization it cannot undo), no weights or a shard of them missing, no tokenizer files
(`regenerate`: no chat template). The stop ids a generation config names come from here too, and the shape facts
(layers, hidden size, vocabulary) that the train command checks its taps and mask id against, and eval checks an
export against. The training config's checks of its target (`check_target`, `check_target_dir`,
`check_target_loads`) live here too.
"""
from __future__ import annotations

import ast
import hashlib
import importlib.util
import json
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import TYPE_CHECKING

from trainer.errors import ConfigError

if TYPE_CHECKING:
    from trainer.config import ModelCfg, TrainCfg

# Hybrids of Gated DeltaNet and full-attention layers: trainer.model.linear_attention computes their linear layers
# per packed document. (Qwen3.6 ships as model_type qwen3_5 / qwen3_5_moe.)
GATED_DELTANET_FAMILIES = ("qwen3_next", "qwen3_5", "qwen3_5_text", "qwen3_5_moe", "qwen3_5_moe_text")
# Families whose layers include state-space or other linear mixers: their features come from layers this trainer
# does not mask per document, so a packed row would leak across documents. (Also caught by `layer_types` values.)
UNSUPPORTED_MIXERS = ("jamba", "zamba", "zamba2", "bamba", "falcon_h1", "granitemoehybrid", "nemotron_h", "lfm2",
                      "minimax", "mamba", "mamba2", "rwkv", "recurrent_gemma")
SOFTMAX_LAYER_TYPES = ("full_attention", "sliding_attention")  # HF's names (model.attention FULL, SLIDING)
LINEAR_LAYER_TYPE = "linear_attention"  # Gated DeltaNet (model.linear_attention LINEAR)
SUPPORTED_HINT = ("use a softmax-attention target (Qwen3, Qwen2.5, Llama 3, Mistral, Gemma, gpt-oss, Qwen3-MoE, "
                  "Mixtral) or a Gated DeltaNet hybrid (Qwen3-Next, Qwen3.5, Qwen3.6)")
CHAT_TEMPLATE_FILES = ("chat_template.jinja", "chat_template.json")  # transformers >= 4.43 saves the template apart
# What transformers' tokenizers load from (a fast tokenizer's one file; sentencepiece; BPE vocabularies; Mistral's
# tekken): tokenizer_config.json alone builds an empty tokenizer, and every prompt would tokenize to nothing.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "tekken.json", "spiece.model")
WEIGHT_FILES = ("model.safetensors", "pytorch_model.bin")  # one file, or its `.index.json` over shards
# Sub-configs of a multimodal checkpoint: its language model is one part of a larger model (Gemma 3 from 4B up,
# Mistral 3, Llama 4), whose weights and layers are named apart.
MULTIMODAL_KEYS = ("vision_config", "audio_config", "vision_tower", "mm_projector_type")
# Multimodal checkpoints whose language model transformers' AutoModelForCausalLM loads alone (its "VLM
# compatibility" mapping: the text config and the language model's weights; the vision tower is not read).
TEXT_OF_MULTIMODAL = ("qwen3_5", "qwen3_5_moe")
# Quantized checkpoints transformers can turn back into bf16 weights on load (gpt-oss's MXFP4 experts).
DEQUANTIZABLE = ("mxfp4",)


@dataclass(frozen=True)
class TargetDir:
    path: Path
    model_type: str
    config_sha256: str  # of config.json's bytes: which model answered, for provenance
    has_chat_template: bool
    generation_eos_ids: tuple[int, ...]  # generation_config.json's eos_token_id (int or list), else config.json's
    max_positions: int | None  # max_position_embeddings, where config.json says


def family_refusal(model_type: str, layer_types) -> ConfigError | None:
    """The layer rule on a config's model_type and layer_types: softmax attention (full or sliding-window), and
    Gated DeltaNet layers in the families that have them. Pure."""
    allowed = SOFTMAX_LAYER_TYPES + ((LINEAR_LAYER_TYPE,) if model_type in GATED_DELTANET_FAMILIES else ())
    unsupported = sorted(set(layer_types or ()) - set(allowed))
    if model_type in UNSUPPORTED_MIXERS or unsupported:
        what = f" (layer types {unsupported})" if unsupported else ""
        return ConfigError(f"target family {model_type!r}{what} mixes in state-space or linear-attention layers "
                           "this trainer cannot mask per document: its features would leak across packed "
                           "documents", hint=SUPPORTED_HINT)
    return None


def text_config(config: dict) -> dict:
    """The language model's part of a config.json: its text_config where it is a multimodal one that transformers
    loads as a causal LM (TEXT_OF_MULTIMODAL), else the config itself."""
    nested = config.get("text_config")
    if config.get("model_type") in TEXT_OF_MULTIMODAL and isinstance(nested, dict):
        return nested
    return config


def quantization_refusal(path: Path, config: dict) -> ConfigError | None:
    """A quantized checkpoint this trainer would read as something other than its weights. Pure."""
    quant = config.get("quantization_config")
    if not isinstance(quant, dict):
        return None
    method = quant.get("quant_method")
    if method in DEQUANTIZABLE:
        return None
    return ConfigError(f"target {path}: its weights are quantized ({method!r}); this trainer reads bf16 (or fp32) "
                       "weights, and MXFP4 ones it dequantizes", hint="point it at the unquantized checkpoint")


@lru_cache(maxsize=1)
def causal_lm_families() -> frozenset[str] | None:
    """The model types the installed transformers has a causal LM class for, read from the source of its auto
    mapping without importing it (importing transformers imports torch). None when that source cannot be read this
    way (another layout): the check is then left to loading, which refuses the same directories after torch."""
    spec = importlib.util.find_spec("transformers")
    if spec is None or not spec.submodule_search_locations:
        return None
    source = Path(list(spec.submodule_search_locations)[0]) / "models" / "auto" / "modeling_auto.py"
    try:
        tree = ast.parse(source.read_text(encoding="utf-8"))
        for node in tree.body:
            if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "MODEL_FOR_CAUSAL_LM_MAPPING_NAMES"
                                                    for t in node.targets):
                return frozenset(k for k, _v in ast.literal_eval(node.value.args[0]))
    except (OSError, SyntaxError, ValueError, AttributeError, IndexError, TypeError):
        return None
    return None


def _ids(value) -> tuple[int, ...]:
    if isinstance(value, bool):
        return ()
    if isinstance(value, int):
        return (value,)
    if isinstance(value, list):
        return tuple(v for v in value if isinstance(v, int) and not isinstance(v, bool))
    return ()


def _json_file(path: Path, what: str) -> dict:
    try:
        obj = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ConfigError(f"target {path.parent}: cannot read its {what} ({str(e).splitlines()[0][:160]})",
                          hint="point --target at a Hugging Face model directory") from None
    if not isinstance(obj, dict):
        raise ConfigError(f"target {path.parent}: its {what} is not a JSON object")
    return obj


def has_chat_template(path: Path) -> bool:
    if any((path / name).is_file() for name in CHAT_TEMPLATE_FILES):
        return True
    config = path / "tokenizer_config.json"
    if not config.is_file():
        return False
    return bool(_json_file(config, "tokenizer_config.json").get("chat_template"))


def read_target_dir(path: str | Path) -> TargetDir:
    """A target directory -> its TargetDir, or one ConfigError naming what is wrong (exit 2)."""
    path = Path(path)
    hint = "point --target at a local Hugging Face model directory"
    if not path.exists():
        raise ConfigError(f"target directory {path} does not exist", hint=hint)
    if not path.is_dir():
        raise ConfigError(f"target {path} is not a directory", hint=hint)
    config_path = path / "config.json"
    if not config_path.is_file():
        raise ConfigError(f"target directory {path} has no config.json", hint=hint)
    config = _json_file(config_path, "config.json")
    model_type = config.get("model_type")
    if not isinstance(model_type, str) or not model_type:
        raise ConfigError(f"target {path}: config.json names no model_type (unknown family)", hint=hint)
    text = text_config(config)
    refusal = family_refusal(text.get("model_type", model_type), text.get("layer_types")) or \
        quantization_refusal(path, config)
    if refusal is not None:
        raise refusal
    multimodal = [k for k in MULTIMODAL_KEYS if config.get(k)]
    if multimodal and model_type not in TEXT_OF_MULTIMODAL:
        raise ConfigError(f"target {path}: {model_type!r} is a multimodal checkpoint (config.json has "
                          f"{multimodal[0]}); this trainer reads a text-only causal LM",
                          hint="use the text-only model of that family (e.g. Gemma 3 1B, model_type gemma3_text)")
    known = causal_lm_families()
    if known is not None and model_type not in known:
        raise ConfigError(f"target {path}: unknown family {model_type!r}: the installed transformers has no causal "
                          "LM for it", hint="point --target at a causal LM this transformers version supports")
    weight_files(path)
    if not any((path / name).is_file() for name in TOKENIZER_FILES):
        raise ConfigError(f"target {path}: no tokenizer files (one of {', '.join(TOKENIZER_FILES)})",
                          hint="copy the model's tokenizer files into the directory (save_pretrained writes them)")
    gen_path = path / "generation_config.json"
    eos = _ids(_json_file(gen_path, "generation_config.json").get("eos_token_id")) if gen_path.is_file() else ()
    return TargetDir(path=path, model_type=model_type,
                     config_sha256=hashlib.sha256(config_path.read_bytes()).hexdigest(),
                     has_chat_template=has_chat_template(path),
                     generation_eos_ids=eos or _ids(config.get("eos_token_id")),
                     max_positions=_positions(config))


def check_answers_fit(target: TargetDir, given: str, command: str, max_new: int) -> None:
    """A target that answers rendered prompts (regenerate, eval prompts): a chat template to render them with, and
    room for a prompt beside --max-new new tokens in its positions; else one ConfigError (exit 2)."""
    if not target.has_chat_template:
        raise ConfigError(f"target {given} has no chat template: {command} renders each prompt with it",
                          hint="use a chat (instruct) target, or add a chat_template to its tokenizer_config.json")
    if target.max_positions is not None and max_new >= target.max_positions:
        raise ConfigError(f"--max-new {max_new} leaves no room for a prompt in the target's {target.max_positions} "
                          f"positions", hint=f"pass --max-new below {target.max_positions}")


def weight_files(path: Path) -> list[Path]:
    """The directory's weight files: one of WEIGHT_FILES, or every shard its index names, all there; else one
    ConfigError (a partial download otherwise fails only once the model loads, after torch and the data)."""
    for name in WEIGHT_FILES:
        if (path / name).is_file():
            return [path / name]
    for name in WEIGHT_FILES:
        index_path = path / f"{name}.index.json"
        if not index_path.is_file():
            continue
        weight_map = _json_file(index_path, index_path.name).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise ConfigError(f"target {path}: {index_path.name} has no weight_map")
        shards = sorted({str(f) for f in weight_map.values()})
        missing = [f for f in shards if not (path / f).is_file()]
        if missing:
            more = f" and {len(missing) - 1} more" if len(missing) > 1 else ""
            raise ConfigError(f"target {path}: shard {missing[0]}{more} of {index_path.name} is missing",
                              hint="finish the download (e.g. huggingface-cli download) and retry")
        return [path / f for f in shards]
    raise ConfigError(f"target {path}: no weights ({' or '.join(WEIGHT_FILES)}, or their .index.json)",
                      hint="point it at a downloaded Hugging Face model directory")


FINGERPRINT_SAMPLES = 64  # 4 KiB reads spread over each weight file
_SAMPLE = 4096


def weights_fingerprint(path: str | Path) -> str:
    """Which weights these are, in milliseconds whatever their size: the sha256 of every weight file's name and size
    and FINGERPRINT_SAMPLES 4 KiB reads spread evenly through it. Two fine-tunes of one base share config.json and
    every file size; their values differ in the sampled bytes unless nearly all of them are equal."""
    digest = hashlib.sha256()
    for file in weight_files(Path(path)):
        size = file.stat().st_size
        digest.update(f"{file.name}\0{size}\0".encode())
        with open(file, "rb") as f:
            for i in range(FINGERPRINT_SAMPLES):
                f.seek(max(0, size - _SAMPLE) * i // max(1, FINGERPRINT_SAMPLES - 1))
                digest.update(f.read(_SAMPLE))
    return digest.hexdigest()


def _positions(config: dict) -> int | None:
    """max_position_embeddings, top level or in a multimodal config's text_config."""
    for holder in (config, config.get("text_config") if isinstance(config.get("text_config"), dict) else {}):
        value = holder.get("max_position_embeddings")
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    return None


@dataclass(frozen=True)
class TargetShape:
    """What config.json says of the target's shape; None where it does not say."""

    num_layers: int | None
    hidden_size: int | None
    vocab_size: int | None  # the embedding's rows (HF keeps vocab_size equal to them, resize included)

    def describe(self) -> str:
        def say(value):
            return "?" if value is None else value

        return f"{say(self.num_layers)} layers, hidden size {say(self.hidden_size)}, vocabulary {say(self.vocab_size)}"


def _positive_int(holder: dict, key: str) -> int | None:
    value = holder.get(key)
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


def read_shape(path: str | Path) -> TargetShape:
    """A target directory's TargetShape from its config.json (a multimodal config's text_config where the top
    level does not say), or one ConfigError when config.json is missing or unreadable."""
    path = Path(path)
    config_path = path / "config.json"
    if not config_path.is_file():
        raise ConfigError(f"target directory {path} has no config.json",
                          hint="point it at a local Hugging Face model directory")
    config = _json_file(config_path, "config.json")
    text = config.get("text_config") if isinstance(config.get("text_config"), dict) else {}

    def fact(key: str) -> int | None:
        top = _positive_int(config, key)
        return top if top is not None else _positive_int(text, key)

    return TargetShape(num_layers=fact("num_hidden_layers"), hidden_size=fact("hidden_size"),
                       vocab_size=fact("vocab_size"))


def default_layer_ids(num_target_layers: int, num_draft_layers: int) -> list[int]:
    """DFlash spacing (z-lab `build_target_layer_ids`): one layer -> [L // 2]; else round(linspace(1, L-3, n)).
    Here, without torch, so that the taps are checked before anything loads; trainer.model.target uses it too."""
    if num_draft_layers == 1:
        return [num_target_layers // 2]
    start, end = 1, num_target_layers - 3
    span = end - start
    return [int(round(start + i * span / (num_draft_layers - 1))) for i in range(num_draft_layers)]


def tap_ids(num_layers: int, num_draft_layers: int, layer_ids: tuple[int, ...] | None) -> tuple[int, ...]:
    """The tapped layers (model.target_layer_ids, else the default spacing) of a target of `num_layers` layers, or
    one ConfigError: taps are distinct, ascending and inside the target. Pure; before torch (check_model_fits) and
    when the target loads (trainer.model.target.prepare_target)."""
    ids = tuple(layer_ids) if layer_ids is not None else tuple(default_layer_ids(num_layers, num_draft_layers))
    if not all(0 <= i < num_layers for i in ids) or list(ids) != sorted(set(ids)):
        source = "model.target_layer_ids" if layer_ids is not None else \
            f"the default tap spacing for {num_layers} target layers and {num_draft_layers} draft layers"
        raise ConfigError(f"{source} gives {list(ids)}; taps must be distinct, ascending and within "
                          f"0..{num_layers - 1}",
                          hint="set model.target_layer_ids explicitly (or use fewer draft layers)")
    return ids


def check_model_fits(shape: TargetShape, *, num_draft_layers: int, layer_ids: tuple[int, ...] | None,
                     mask_token_id: int | None) -> None:
    """The taps and an explicit mask id against the target's layer count and vocabulary, with the messages that
    loading the target (trainer.model.target.prepare_target, resolve_mask_token_id) gives. Pure. What config.json
    does not say is left to loading."""
    if shape.num_layers is not None:
        tap_ids(shape.num_layers, num_draft_layers, layer_ids)
    if mask_token_id is not None and shape.vocab_size is not None:
        check_mask_row(mask_token_id, "model.mask_token_id", shape.vocab_size)


def check_drafter_fits(shape: TargetShape, m: ModelCfg) -> None:
    """A DFlash2 drafter's convolution groups and selector top-k against the target's hidden size (the drafter's
    width) and vocabulary. Pure; what config.json does not say is left to building the drafter."""
    if m.drafter != "dflash2":
        return
    group, top_k = m.dflash2.resolved("conv_group_size"), m.dflash2.resolved("selector_top_k")
    if shape.hidden_size is not None and shape.hidden_size % group:
        raise ConfigError(f"model.dflash2.conv_group_size={group} does not divide the drafter's width (the target's hidden "
                          f"size {shape.hidden_size})", hint="set model.dflash2.conv_group_size to a divisor of it")
    if shape.vocab_size is not None and top_k > shape.vocab_size:
        raise ConfigError(f"model.dflash2.selector_top_k={top_k} is more than the target's vocabulary ({shape.vocab_size})",
                          hint="set model.dflash2.selector_top_k to at most the vocabulary size")


def check_mask_row(mask_id: int, source: str, rows: int) -> None:
    """The mask id must be a row of the target's embedding of `rows` rows; `source` says where the id came from.
    Before torch (check_model_fits) and when the target loads (trainer.model.target.resolve_mask_token_id)."""
    if not 0 <= mask_id < rows:
        raise ConfigError(f"mask token id {mask_id} ({source}) is not a row of the target embedding (0..{rows - 1})",
                          hint="set model.mask_token_id to a reserved row inside the embedding")


# ---------------------------------------------------------------- a training config's checks of its target

def check_target(cfg: TrainCfg) -> None:
    """The empty-input rules, target first: model.target names a local HF directory, or is empty where the tiny
    test target is allowed (model.allow_tiny_target); data.paths lists the training data (the gpu recipe leaves it
    empty: a forgotten --set must not train a real target on the bundled toy set). Pure (the directory itself is
    checked by `check_target_dir`, the files by the data scan)."""
    if not cfg.model.target and not cfg.model.allow_tiny_target:
        raise ConfigError("model.target is empty: set model.target=DIR (a local Hugging Face model directory)",
                          hint="e.g. --set model.target=/models/Qwen3-8B")
    if not cfg.data.paths:
        raise ConfigError("data.paths is empty: name the training JSONL files with --set 'data.paths=[...]'")


def check_target_dir(cfg: TrainCfg) -> None:
    """model.target, when set, must be a target directory this trainer can load (`read_target_dir`: its
    family, weights and tokenizer files) whose config.json the taps and model.mask_token_id fit (its layer count and
    vocabulary): read before anything is loaded. Unset, the taps must fit the tiny target before it is built."""
    check_target(cfg)
    if cfg.model.target and not (Path(cfg.model.target) / "config.json").is_file():
        raise ConfigError(f"model.target={cfg.model.target}: no config.json there",
                          hint="set model.target to a local Hugging Face model directory")
    if cfg.model.target:
        check_target_loads(cfg.model, cfg.model.target)
        check_drafter_fits(read_shape(cfg.model.target), cfg.model)
    else:  # the tiny target, built later (trainer.tiny): its layer count is known now
        from trainer.tiny import TINY_HIDDEN, TINY_NUM_LAYERS

        tiny = TargetShape(num_layers=TINY_NUM_LAYERS, hidden_size=TINY_HIDDEN, vocab_size=None)
        check_model_fits(tiny, num_draft_layers=cfg.model.num_draft_layers, layer_ids=cfg.model.target_layer_ids,
                         mask_token_id=None)
        check_drafter_fits(tiny, cfg.model)


def check_target_loads(m: ModelCfg, target: str) -> None:
    """`target` is a directory this trainer can load (`read_target_dir`) whose config.json the model settings' taps
    and mask id fit. Before torch: the start's check, and the export's of a target that moved."""
    read_target_dir(target)
    check_model_fits(read_shape(target), num_draft_layers=m.num_draft_layers, layer_ids=m.target_layer_ids,
                     mask_token_id=m.mask_token_id)
