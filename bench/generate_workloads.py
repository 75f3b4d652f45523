"""The workloads of `bench.generate` (its docstring): the equal batch and the mixed prompts with their chain target,
and `equal_like`, the equal workload a mixed one is compared with."""
from __future__ import annotations

import random
import statistics


def mixed_lengths(n: int, seed: int, min_prompt: int, max_prompt: int, mean_new: int, max_new: int) \
        -> list[tuple[int, int]]:
    """(prompt tokens, answer tokens) of `n` prompts, seeded: prompts uniform in [min_prompt, max_prompt], answers
    exponential of mean `mean_new` cut to [1, max_new]; the first is (max_prompt, max_new). Pure."""
    rng = random.Random(seed)
    out = [(max_prompt, max_new)]
    for _ in range(n - 1):
        out.append((rng.randint(min_prompt, max_prompt), min(max_new, max(1, round(rng.expovariate(1 / mean_new))))))
    return out[:n]


RESIDUAL_WRITES = ("o_proj", "down_proj", "out_proj")


def make_chain(model, seed: int) -> list[int]:
    """Turn a random model into the chain target (module docstring) -> the cycle: order[i + 1] follows order[i],
    order[0] is the stop id."""
    import torch

    with torch.no_grad():
        for name, param in model.named_parameters():
            if any(w in name for w in RESIDUAL_WRITES):
                param.zero_()
        embed, head = model.get_input_embeddings().weight, model.get_output_embeddings().weight
        if head.data_ptr() == embed.data_ptr():  # tied: the head gets its own rows
            model.get_output_embeddings().weight = head = torch.nn.Parameter(embed.detach().clone(),
                                                                             requires_grad=False)
        order = torch.randperm(embed.shape[0], generator=torch.Generator().manual_seed(seed))
        # head row of order[i + 1] = embedding of order[i]: the argmax after order[i] is order[i + 1]
        head[order.roll(-1).to(head.device)] = embed[order.to(embed.device)]
    return order.tolist()


def mixed_prompts(lengths: list[tuple[int, int]], order: list[int], seed: int) -> list[list[int]]:
    """Prompts of the drawn lengths whose last token lies `answer` steps before the stop id (order[0])."""
    rng = random.Random(seed + 1)
    vocab = len(order)
    return [[rng.randrange(vocab) for _ in range(p - 1)] + [order[-a % vocab]] for p, a in lengths]


def bench_prompts(batch: int, longest: int, vocab: int, seed: int = 1) -> list[list[int]]:
    """`batch` random prompts of seeded lengths in [ceil(longest / 2), longest]; the first is `longest` long."""
    import torch

    g = torch.Generator().manual_seed(seed)
    lengths = [longest] + torch.randint(-(-longest // 2), longest + 1, (batch - 1,), generator=g).tolist()
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in lengths]


def workload(args, target) -> tuple[list[list[int]], list[int], list[int] | None, float]:
    """-> (the prompts, longest first; stop ids; each prompt's drawn answer length or None; the mean context of a
    decode step)."""
    vocab = target.embed_tokens.weight.shape[0]
    if args.workload == "equal":
        prompts = bench_prompts(args.batch, args.prompt_tokens, vocab, args.seed)
        return prompts, [], None, statistics.mean(map(len, prompts)) + args.new_tokens / 2
    lengths = mixed_lengths(args.prompts, args.seed, args.min_prompt_tokens, args.prompt_tokens,
                            args.mean_new_tokens, args.new_tokens)
    lengths.sort(key=lambda pa: -pa[0])  # stable: regenerate's order
    order = make_chain(target.model, args.seed)
    prompts = mixed_prompts(lengths, order, args.seed)
    context = statistics.mean(p + a / 2 for p, a in lengths)
    return prompts, [order[0]], [a for _, a in lengths], context


def equal_mean_prompt(longest: int, batch: int) -> float:
    """The expected mean prompt of `bench_prompts(batch, longest)`: the first `longest`, the others uniform in
    [ceil(longest / 2), longest]. Pure."""
    return (longest + (batch - 1) * (-(-longest // 2) + longest) / 2) / batch


def equal_like(rows: int, prompt_lengths: list[int], answer_lengths: list[int], shape: str, extra: str = "") -> dict:
    """The equal workload (one batch of `rows`, every answer `--new-tokens` long) with a mixed workload's mean prompt
    and mean answer, so the same mean context: `--prompt-tokens` the longest prompt whose equal draw's expected
    mean is nearest the mixed mean prompt (the smaller on a tie), `--new-tokens` the mean answer rounded; and the
    command that measures it (`extra`: flags to carry, e.g. --target-fp8 1). Pure."""
    prompt, answer = statistics.fmean(prompt_lengths), statistics.fmean(answer_lengths)
    longest = min(range(1, 2 * max(prompt_lengths) + 2), key=lambda n: abs(equal_mean_prompt(n, rows) - prompt))
    new = max(1, round(answer))
    command = (f"python3 -m bench.generate --shape {shape} --batch {rows} --prompt-tokens {longest} "
               f"--new-tokens {new} --engines static {extra}").strip()
    return {"rows": rows, "mean_prompt": round(prompt, 1), "mean_answer": round(answer, 1), "prompt_tokens": longest,
            "new_tokens": new, "equal_mean_prompt": round(equal_mean_prompt(longest, rows), 1), "command": command}
