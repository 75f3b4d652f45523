"""Build a tiny Qwen3 target + tokenizer offline (no downloads) and save them with `save_pretrained`.

Used by the tests (session fixture), by the smoke recipe (when model.target is empty) and by
`python -m trainer make-tiny-target OUT_DIR`.
"""
from __future__ import annotations

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


def build_tiny_target(out_dir: str | Path, *, num_layers: int = 6, hidden: int = 64, seed: int = 0,
                      tie_word_embeddings: bool = True, train_steps: int = 100) -> Path:
    """Qwen3ForCausalLM (hidden 64, 4 heads / 2 KV heads) + tokenizer, saved to `out_dir`.

    The model is briefly trained on the bundled smoke conversations (`train_steps`, a few seconds on CPU), so its
    greedy tokens follow the data: a drafter can then reach tau > 1 against it, as with a real target.
    """
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer()
    cfg = Qwen3Config(vocab_size=len(tokenizer), hidden_size=hidden, intermediate_size=2 * hidden,
                      num_hidden_layers=num_layers, num_attention_heads=4, num_key_value_heads=2,
                      head_dim=hidden // 4, max_position_embeddings=4096, tie_word_embeddings=tie_word_embeddings,
                      pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id,
                      bos_token_id=None)
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = Qwen3ForCausalLM(cfg)
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
