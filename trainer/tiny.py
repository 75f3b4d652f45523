"""Build a tiny Qwen3 target + tokenizer offline (no downloads) and save them with `save_pretrained`.

Used by the tests (session fixture), by the smoke recipe (when model.target is empty) and by
`python -m trainer make-tiny-target OUT_DIR [--family llama --hidden 1024 --layers 12 --train-steps 0]` (the last: a
random Llama 3 target of the small benchmark shape, with the same tokenizer and chat template).
"""
from __future__ import annotations

import os
from pathlib import Path

SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|MASK|>", "<unk>")
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def build_tokenizer():
    """A WordLevel tokenizer over the smoke vocabulary, with Qwen-style special tokens and chat template."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers, decoders
    from transformers import PreTrainedTokenizerFast

    from trainer.smoke_data import vocabulary_text

    tok = Tokenizer(models.WordLevel(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    trainer = trainers.WordLevelTrainer(special_tokens=list(SPECIAL_TOKENS), min_frequency=1)
    tok.train_from_iterator([vocabulary_text()], trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>", pad_token="<|endoftext|>",
                                   unk_token="<unk>", additional_special_tokens=["<|im_start|>", "<|im_end|>", "<|MASK|>"])
    fast.chat_template = CHAT_TEMPLATE
    return fast


FAMILIES = ("qwen3", "llama")
TINY_NUM_LAYERS = 6  # the smoke recipe's target: its taps are checked against this before it is built
TINY_HIDDEN = 64  # and its width, which a DFlash2 drafter's convolution groups must divide


def check_out_dir(out_dir: str | Path) -> None:
    """`make-tiny-target OUT_DIR` writes a new directory: refuse (ConfigError, one line) a path that is a file or lies
    in one, a directory that already holds anything (its model files would be overwritten), and a place that cannot
    be written. No torch: checked before it is imported."""
    from trainer.errors import ConfigError

    out = Path(out_dir)
    if out.is_dir():
        held = sorted(p.name for p in out.iterdir())
        if held:
            shown = ", ".join(held[:4]) + (", ..." if len(held) > 4 else "")
            raise ConfigError(f"{out} is not empty ({shown}): make-tiny-target writes a new directory and "
                              "overwrites nothing", hint="pass a new or empty OUT_DIR")
        return
    if out.exists() or out.is_symlink():
        raise ConfigError(f"{out} is a file, not a directory", hint="pass a new or empty OUT_DIR")
    parent = out.parent
    while not parent.exists():
        parent = parent.parent
    if not parent.is_dir():
        raise ConfigError(f"{out}: {parent} is a file, not a directory", hint="pass a new or empty OUT_DIR")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise ConfigError(f"cannot create {out}: {parent} is not writable", hint="pass a new or empty OUT_DIR")


def model_config(family: str, vocab: int, num_layers: int, hidden: int, tie_word_embeddings: bool, **ids):
    """A Qwen3 or Llama 3 config: 64-wide heads from hidden 256 up (at least 4 heads), half as many KV heads,
    MLP 2x (tiny) or 3x (from hidden 256) hidden; Llama with Llama 3.1's RoPE scaling."""
    from transformers import LlamaConfig, Qwen3Config

    heads = max(4, hidden // 64)
    common = dict(vocab_size=vocab, hidden_size=hidden, intermediate_size=(3 if hidden >= 256 else 2) * hidden,
                  num_hidden_layers=num_layers, num_attention_heads=heads, num_key_value_heads=heads // 2,
                  head_dim=hidden // heads, max_position_embeddings=4096, tie_word_embeddings=tie_word_embeddings,
                  **ids)
    if family == "qwen3":
        return Qwen3Config(**common)
    if family == "llama":
        return LlamaConfig(**common, rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                                   "high_freq_factor": 4.0, "original_max_position_embeddings": 8192})
    raise ValueError(f"family must be one of {FAMILIES}, got {family!r}")


def build_tiny_target(out_dir: str | Path, *, num_layers: int = TINY_NUM_LAYERS, hidden: int = TINY_HIDDEN, seed: int = 0,
                      tie_word_embeddings: bool = True, train_steps: int = 100, family: str = "qwen3") -> Path:
    """A causal LM of `family` (default: Qwen3, hidden 64, 4 heads / 2 KV heads) + tokenizer, saved to `out_dir`.

    The model is briefly trained on the bundled smoke conversations (`train_steps`, a few seconds on CPU at the
    default size), so its greedy tokens follow the data: a drafter can then reach tau > 1 against it, as with a real
    target. train_steps=0 keeps the random initialisation (a random target of a given shape, e.g. for benchmarks).
    """
    import torch
    from transformers import AutoModelForCausalLM

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer()
    cfg = model_config(family, len(tokenizer), num_layers, hidden, tie_word_embeddings,
                       pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id, bos_token_id=None)
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(cfg)
        _pretrain(model, tokenizer, train_steps)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def _pretrain(model, tokenizer, steps: int, batch: int = 16) -> None:
    """Plain next-token training on the smoke conversations (padded batches, pad positions ignored)."""
    import torch

    from trainer.smoke_data import conversations

    if steps <= 0:
        return
    texts = [tokenizer.apply_chat_template(c["conversations"], tokenize=False) for c in conversations()]
    seqs = [torch.tensor(tokenizer(t, add_special_tokens=False)["input_ids"]) for t in texts]
    opt = torch.optim.AdamW(model.parameters(), lr=5e-3)
    model.train()
    for step in range(steps):
        idx = torch.randint(len(seqs), (batch,))
        ids = torch.nn.utils.rnn.pad_sequence([seqs[i] for i in idx], batch_first=True, padding_value=-100)
        labels = ids.clone()
        ids = ids.clamp_min(0)
        loss = model(input_ids=ids, labels=labels).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    model.eval()
