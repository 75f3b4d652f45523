"""The frozen target: a local HF causal LM, tapped with forward hooks, truncated after the last tap for training.

Families: any decoder whose layers are softmax attention, full or sliding-window, dense or MoE (Qwen3, Qwen2/2.5,
Llama 3, Mistral, Gemma 2/3, Qwen3-MoE, Mixtral, gpt-oss with its attention sinks), and the Gated DeltaNet hybrids
(Qwen3-Next, Qwen3.5, Qwen3.6). A packed row holds several documents, so the target gets its masks from here, per
kind of layer: causal AND same document, AND inside the window for sliding layers (HF's own window rule: a query
sees the `sliding_window` keys ending at itself); linear-attention layers get the doc ids themselves and restart
their convolution and recurrent state at every document (trainer.model.linear_attention). Other state-space or
linear mixers are refused before any weight is loaded. MoE experts run HF's grouped GEMMs (`grouped_mm`: one GEMM
per projection for all experts, no host sync), so the step stays capturable.

Tap semantics are HF's `hidden_states[i + 1]`, what the serving stacks feed the drafter: the raw output of layer i,
except the last layer's, which HF reports after the final norm.

Shape legend: R rows, S tokens per packed row, T taps, D hidden.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from trainer.errors import ConfigError
from trainer.model.attention import FULL, SLIDING
from trainer.model.linear_attention import LINEAR, PackedDocs, is_linear_attention_layer, use_packed_linear_attention
from trainer.targetdir import SUPPORTED_HINT, check_mask_row, default_layer_ids, family_refusal, tap_ids

MASK_TOKEN = "<|MASK|>"


@dataclass(frozen=True)
class AttentionKinds:
    """Per decoder layer: full, sliding-window or linear (Gated DeltaNet) attention, and the window."""

    layer_types: tuple[str, ...]
    window: int | None

    @property
    def kinds(self) -> tuple[str, ...]:
        return tuple(sorted(set(self.layer_types)))


def attention_kinds(hf_config) -> AttentionKinds:
    """From the HF config alone (before any weight is loaded): the layers' attention kinds, or one ConfigError that
    names the family and what to do."""
    model_type = getattr(hf_config, "model_type", "?")
    n = hf_config.num_hidden_layers
    types = getattr(hf_config, "layer_types", None)
    window = getattr(hf_config, "sliding_window", None)
    refusal = family_refusal(model_type, types)
    if refusal is not None:
        raise refusal
    if types is None:  # Mistral-style configs: one window (or none) for every layer
        types = [SLIDING if window else FULL] * n
    types = tuple(types)
    if len(types) != n:
        raise ConfigError(f"target config has {len(types)} layer_types for {n} layers",
                          hint="fix the target's config.json")
    if SLIDING in types and not (isinstance(window, int) and window > 0):
        raise ConfigError(f"target config has sliding-window layers but sliding_window={window!r}",
                          hint="fix the target's config.json")
    return AttentionKinds(layer_types=types, window=window if SLIDING in types else None)


# DFlash's tap spacing has its torch-free home beside the other config.json facts (checked before torch loads)
build_target_layer_ids = default_layer_ids


def resolve_mask_token_id(tokenizer, vocab_rows: int, requested: int | None, log=None) -> int:
    """The mask id must be a real row of the target embedding and not pad/eos (else tau ~ 1 silently).

    In order: model.mask_token_id; the tokenizer's mask token; its `<|MASK|>` token; else the first embedding row
    past the tokenizer's vocabulary, when the embedding has spare rows (Qwen3: 151669, the id the published DFlash
    drafters use) -- said in the log, since no token names it."""
    if requested is not None:
        mask_id = requested
        source = "model.mask_token_id"
    elif getattr(tokenizer, "mask_token_id", None) is not None:
        mask_id, source = tokenizer.mask_token_id, "tokenizer.mask_token_id"
    else:
        mask_id = tokenizer.convert_tokens_to_ids(MASK_TOKEN)
        source = f"tokenizer token {MASK_TOKEN}"
        if mask_id is None or mask_id == getattr(tokenizer, "unk_token_id", object()):
            spare = len(tokenizer)
            if spare >= vocab_rows:
                raise ConfigError(f"the target tokenizer has no mask token and no {MASK_TOKEN}, and the embedding has "
                                  f"no spare row past its {spare} tokens",
                                  hint="set model.mask_token_id to a reserved, unused row of the target embedding")
            mask_id, source = spare, "the first embedding row past the tokenizer's vocabulary"
            (log or print)(f"mask token: id {mask_id}, {source} (the tokenizer has no mask token; "
                           f"--set model.mask_token_id=N to choose another)")
    check_mask_row(mask_id, source, vocab_rows)
    hits = [name for name, tok_id in (("pad", tokenizer.pad_token_id), ("eos", tokenizer.eos_token_id))
            if tok_id is not None and mask_id == tok_id]
    if hits:
        raise ConfigError(f"mask token id {mask_id} ({source}) is the {'/'.join(hits)} token",
                          hint="set model.mask_token_id to a reserved token that is neither pad nor eos")
    return mask_id


def packed_causal_mask(doc_ids: torch.Tensor, window: int | None = None) -> torch.Tensor:
    """[R, 1, S, S] bool: causal AND same document (block-diagonal causal), AND i - j < window when given.
    Padding (-1) attends causally to padding."""
    S = doc_ids.shape[1]
    idx = torch.arange(S, device=doc_ids.device)
    visible = idx[None, :] <= idx[:, None]
    if window is not None:
        visible = visible & (idx[:, None] - idx[None, :] < window)
    return (visible & (doc_ids[:, :, None] == doc_ids[:, None, :]))[:, None]


@dataclass
class Target:
    """A loaded, frozen HF target. `features` runs only up to the last tapped layer when `truncated`."""

    model: nn.Module  # AutoModelForCausalLM
    tokenizer: object
    layer_ids: tuple[int, ...]
    num_layers: int  # of the full target (for the export config)
    mask_token_id: int
    truncated: bool
    _taps: dict  # layer index -> last output (filled by hooks during `features`)
    attn: str = "sdpa"  # "sdpa": dense packed_causal_mask (reference); "flex": doc-causal BlockMask (CUDA fast path)
    kinds: AttentionKinds | None = None  # None: every layer full attention
    _doc_masks: dict = field(default_factory=dict)  # (rows, seq, device, window) -> DocCausalMask, static per shape

    @property
    def hf_config(self):
        return self.model.config

    @property
    def embed_tokens(self) -> nn.Module:
        return self.model.get_input_embeddings()

    @property
    def lm_head(self) -> nn.Module:
        return self.model.get_output_embeddings()

    @property
    def device(self) -> torch.device:
        return self.embed_tokens.weight.device

    def attention_mask(self, doc_ids: torch.Tensor):
        """The mask(s) handed to HF for packed rows, per kind of layer: one mask when every layer is of one kind,
        else {layer type: mask} (the form HF's mixed-layer models take). Each softmax layer's is the static doc-causal
        BlockMask, rewritten in place (flex; rows whose length is a multiple of the flex tile), or the dense
        [R, 1, S, S] reference; linear-attention layers get the doc ids (PackedDocs). No host sync."""
        kinds = self.kinds.kinds if self.kinds is not None else (FULL,)
        masks = {kind: PackedDocs(doc_ids) if kind == LINEAR else self._mask(doc_ids, self.kinds.window if kind == SLIDING
                                                                  else None) for kind in kinds}
        return masks[kinds[0]] if len(masks) == 1 else masks

    def _mask(self, doc_ids: torch.Tensor, window: int | None):
        from trainer.model.doc_attention import TILE, DocCausalMask

        rows, seq = doc_ids.shape
        if self.attn != "flex" or seq % TILE:
            mask = packed_causal_mask(doc_ids, window)
            if hf_attention(self.model.config) == "eager":  # HF's eager attention adds the mask to the scores
                dtype = self.embed_tokens.weight.dtype
                return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(
                    ~mask, torch.finfo(dtype).min)
            return mask
        key = (rows, seq, doc_ids.device, window)
        if key not in self._doc_masks:  # first call per shape: main thread, during warm-up
            self._doc_masks[key] = DocCausalMask(rows, seq, doc_ids.device, window=window)
        return self._doc_masks[key].update_(doc_ids)

    def join_taps(self, taps: dict, final_norm=None) -> torch.Tensor:
        """The tapped layers' outputs, concatenated [.., T*D], as HF's hidden_states[i + 1]: the last layer's after
        the final norm (`final_norm`: a numerically equivalent stand-in, e.g. the static decoder's)."""
        last = self.num_layers - 1
        norm = final_norm or self.model.model.norm
        return torch.cat([norm(taps[i]) if i == last else taps[i] for i in self.layer_ids], dim=-1)

    @torch.no_grad()
    def features(self, input_ids: torch.Tensor, position_ids: torch.Tensor, doc_ids: torch.Tensor) -> torch.Tensor:
        """Packed rows -> tapped layer outputs concatenated: [R, S, T*D]. Documents never see each other."""
        self._taps.clear()
        self.model.model(input_ids=input_ids, position_ids=position_ids, attention_mask=self.attention_mask(doc_ids),
                         use_cache=False)
        feats = self.join_taps(self._taps)
        self._taps.clear()
        return feats

    @torch.no_grad()
    def features_and_greedy(self, input_ids: torch.Tensor, position_ids: torch.Tensor,
                            doc_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """One full forward -> (features [R, S, T*D], greedy next token [R, S] long). Eval only: needs truncate=False."""
        if self.truncated:
            raise RuntimeError("features_and_greedy needs the full target; load it with truncate=False")
        self._taps.clear()
        out = self.model(input_ids=input_ids, position_ids=position_ids, attention_mask=self.attention_mask(doc_ids),
                         use_cache=False)
        feats = self.join_taps(self._taps)
        self._taps.clear()
        return feats, out.logits.argmax(dim=-1)


def pick_dtype(dtype: str, device: torch.device) -> torch.dtype:
    if dtype == "float32":
        return torch.float32
    if dtype == "bfloat16":
        return torch.bfloat16
    return torch.bfloat16 if device.type == "cuda" else torch.float32


EAGER_FAMILIES = ("gpt_oss",)  # attention sinks: HF computes them in its eager attention only


def hf_attention(hf_config) -> str:
    """HF's attention implementation for the reference path: sdpa, except for families whose attention scores are
    soft-capped (Gemma 2) or that add attention sinks (gpt-oss), which sdpa cannot compute and HF runs eagerly."""
    eager = getattr(hf_config, "attn_logit_softcapping", None) or hf_config.model_type in EAGER_FAMILIES
    return "eager" if eager else "sdpa"


def load_options(config) -> dict:
    """from_pretrained's options a family needs beyond dtype and attention: MoE experts as grouped GEMMs (HF's
    `grouped_mm`; its per-expert loop would sync with the host and could not be captured), and gpt-oss's MXFP4
    experts dequantized to the load dtype (what this trainer computes with; without it transformers would keep them
    packed where its MXFP4 kernels are installed)."""
    options = {}
    text = config.get_text_config()
    if any(getattr(text, key, None) for key in ("num_experts", "num_local_experts")):
        options["experts_implementation"] = "grouped_mm"
    quant = getattr(config, "quantization_config", None)
    method = quant.get("quant_method") if isinstance(quant, dict) else getattr(quant, "quant_method", None)
    if str(getattr(method, "value", method)) == "mxfp4":
        from transformers import Mxfp4Config

        options["quantization_config"] = Mxfp4Config(dequantize=True)
    return options


def load_target(path: str | Path, *, num_draft_layers: int, layer_ids: tuple[int, ...] | None = None,
                mask_token_id: int | None = None, device: str | torch.device = "cpu", dtype: str = "auto",
                truncate: bool = True, attn: str = "sdpa") -> Target:
    """Load tokenizer + model from a local directory (no downloads), then `prepare_target` (freeze, hook, truncate)."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    path = Path(path)
    if not (path / "config.json").is_file():
        raise ConfigError(f"target directory {path} has no config.json",
                          hint="set model.target to a local Hugging Face model directory (or '' for the tiny target)")
    try:
        config = AutoConfig.from_pretrained(path, local_files_only=True)
    except (ValueError, KeyError, OSError) as e:  # an unknown model_type, a broken config.json
        raise ConfigError(f"target {path}: transformers cannot read its config.json ({str(e).splitlines()[0][:200]})",
                          hint="point model.target at a Hugging Face causal LM directory this transformers "
                               "version supports") from None
    attention_kinds(config.get_text_config())  # refuse a family before its weights are read
    device = torch.device(device)
    tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(path, local_files_only=True, dtype=pick_dtype(dtype, device),
                                                 attn_implementation=hf_attention(config),
                                                 **load_options(config)).to(device)
    return prepare_target(model, tokenizer, num_draft_layers=num_draft_layers, layer_ids=layer_ids,
                          mask_token_id=mask_token_id, truncate=truncate, attn=attn)


def prepare_target(model: nn.Module, tokenizer, *, num_draft_layers: int, layer_ids: tuple[int, ...] | None = None,
                   mask_token_id: int | None = None, truncate: bool = True, attn: str = "sdpa") -> Target:
    """An HF causal LM already on its device and dtype -> the frozen, tapped (and truncated) training target.

    attn: "sdpa" (dense packed mask, the reference) or "flex" (doc-causal BlockMask; CUDA fast path, same semantics).
    """
    if attn not in ("sdpa", "flex"):
        raise ValueError(f"target attn must be 'sdpa' or 'flex', got {attn!r}")
    model.requires_grad_(False).eval()
    kinds = attention_kinds(model.config)
    layers = model.model.layers
    n_layers = len(layers)
    plain = [i for i, layer in enumerate(layers) if not hasattr(layer, "self_attn")
             and not is_linear_attention_layer(layer)]
    if plain:
        raise ConfigError(f"target layers {plain[:4]} of {model.config.model_type!r} have neither softmax nor "
                          "Gated DeltaNet attention", hint=SUPPORTED_HINT)
    ids = tap_ids(n_layers, num_draft_layers, layer_ids)
    mask_id = resolve_mask_token_id(tokenizer, model.get_input_embeddings().weight.shape[0], mask_token_id)
    if attn == "flex":
        from trainer.model.doc_attention import use_doc_causal_attention

        use_doc_causal_attention(model)  # flex for BlockMasks, HF's sdpa for anything else
    use_packed_linear_attention(model, model.get_input_embeddings().weight.device)
    taps: dict = {}
    for i in ids:
        layers[i].register_forward_hook(_tap_hook(taps, i))
    if truncate:
        # Layers after the last tap never influence the features: do not run them (final norm + lm_head stay).
        model.model.layers = nn.ModuleList(list(layers)[: ids[-1] + 1])
    return Target(model=model, tokenizer=tokenizer, layer_ids=ids, num_layers=n_layers, mask_token_id=mask_id,
                  truncated=truncate, _taps=taps, attn=attn, kinds=kinds)


def _tap_hook(store: dict, index: int):
    def hook(_module, _inputs, output):
        # Decoder layers return a tensor in transformers 5 and a tuple in 4.x.
        store[index] = output[0] if isinstance(output, tuple) else output

    return hook
