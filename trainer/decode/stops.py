"""Where an answer ends: the one stop rule of regenerate, `eval prompts` and the quality pipeline.

`stop_ids` says which token ids end an answer: the tokenizer's EOS, the generation config's eos ids, the chat
template's end-of-turn marker (when it is one token), and the known end-of-turn tokens the vocabulary has. A target
whose tokenizer's EOS is `<|endoftext|>` but whose template ends a turn with `<|im_end|>` (Qwen's) stops on both,
as a server does; decoding on EOS alone would run every answer to its token limit. `stop_index` and `cut_at_stop`
say where a token list ends: through its first stop id, kept. No torch.
"""
from __future__ import annotations

from collections.abc import Collection, Sequence

# End-of-turn tokens of the chat templates in use (ChatML, Gemma, Llama 3, Phi): a stop wherever the vocabulary
# has them, next to the tokenizer's EOS, the generation config's eos ids and the template's own end marker.
END_OF_TURN_TOKENS = ("<|im_end|>", "<end_of_turn>", "<|eot_id|>", "<|eom_id|>", "<|end|>", "<|endoftext|>")


def stop_ids(tokenizer, generation_eos: Sequence[int] = (), end_marker: str | None = None) -> tuple[int, ...]:
    """The ids an answer ends on, in a stable order: EOS, the generation config's, the template's end marker (when it
    is one token; None: found from the tokenizer's chat template, if it has one), the known end-of-turn tokens the
    vocabulary has."""
    if end_marker is None:
        from trainer.data.source import turn_end_marker

        end_marker = turn_end_marker(tokenizer) if getattr(tokenizer, "chat_template", None) else ""
    unk = getattr(tokenizer, "unk_token_id", None)
    found: list[int] = []

    def add(i) -> None:
        if isinstance(i, int) and i >= 0 and i != unk and i not in found:
            found.append(i)

    add(tokenizer.eos_token_id)
    for i in generation_eos:
        add(i)
    if end_marker:
        ids = tokenizer(end_marker, add_special_tokens=False)["input_ids"]
        if len(ids) == 1:
            add(ids[0])
    vocab = tokenizer.get_vocab()
    for name in END_OF_TURN_TOKENS:
        if name in vocab:
            add(vocab[name])
    return tuple(found)


def model_stop_ids(model, tokenizer) -> tuple[int, ...]:
    """`stop_ids` of a loaded HF model: its generation config's eos ids (generation_config.json's, else
    config.json's, as transformers loads them) and its tokenizer."""
    eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    return stop_ids(tokenizer, [eos] if isinstance(eos, int) else list(eos or ()))


def stop_index(tokens: Sequence[int], stops: Collection[int], max_new: int) -> int | None:
    """Length to keep when generation must stop: through the first stop id, or max_new; None to go on."""
    for i, t in enumerate(tokens[:max_new]):
        if t in stops:
            return i + 1
    return max_new if len(tokens) >= max_new else None


def cut_at_stop(tokens: list[int], stops: Collection[int]) -> list[int]:
    """The tokens through the first stop id (kept); all of them when none occurs."""
    return tokens[:stop_index(tokens, stops, len(tokens)) or len(tokens)]
