"""Greedy continuations of a few prompts, so that a report shows in words what each model writes.

A conversion that collapsed reads as repetition or noise next to its parent's sentence, which a perplexity
figure alone does not show. Greedy decoding is deterministic: the same model writes the same words each run,
and a G = H conversion writes exactly its parent's. Prompt and continuation must fit in the model's positions:
`length_problem` checks that before any model is loaded, from the tokenizer alone.
"""

from __future__ import annotations

import torch

# Used when --generate is given without prompts: one factual, one narrative.
DEFAULT_PROMPTS = ("The capital of France is", "Once upon a time, there was a little girl who")


@torch.inference_mode()
def continuations(model, tokenizer, prompts: list[str], new_tokens: int) -> list[str]:
    """The greedy continuation of each prompt (without the prompt), `new_tokens` tokens at most.

    Each prompt runs alone (no padding), and generation stops early at the end-of-text token.
    """
    from transformers import GenerationConfig

    pad = tokenizer.eos_token_id if tokenizer.pad_token_id is None else tokenizer.pad_token_id
    config = GenerationConfig(
        max_new_tokens=new_tokens, do_sample=False, eos_token_id=tokenizer.eos_token_id, pad_token_id=pad
    )
    device = next(model.parameters()).device
    texts = []
    for prompt in prompts:
        ids = torch.tensor([prompt_ids(tokenizer, prompt)], device=device)
        out = model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=config)
        texts.append(tokenizer.decode(out[0, ids.shape[1] :], skip_special_tokens=True))
    return texts


def prompt_ids(tokenizer, prompt: str) -> list[int]:
    """The token ids `continuations` gives the model for `prompt` (too long a prompt is `length_problem`'s to tell)."""
    return tokenizer(prompt, verbose=False).input_ids


def length_problem(tokenizer, prompts: list[str], new_tokens: int, positions: int, name: str) -> str | None:
    """Why the longest prompt and `new_tokens` more would not fit in the `positions` of model `name`, or None."""
    n, i = max((len(prompt_ids(tokenizer, p)), i) for i, p in enumerate(prompts, 1))
    if n + new_tokens <= positions:
        return None
    if n < positions:
        return (
            f"--generate-tokens {new_tokens:,} after the {n:,}-token --generate prompt {i} exceeds the "
            f"{positions:,} positions of {name}; lower --generate-tokens to {positions - n:,} or shorten the "
            "prompt"
        )
    fix = f"to {positions - new_tokens:,} tokens at most" if new_tokens < positions else "and lower --generate-tokens"
    subject = f"--generate prompt {i} is {n:,} tokens, leaving no room in the {positions:,} positions of {name}"
    return f"{subject}; shorten it {fix}"
