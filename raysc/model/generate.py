"""Autoregressive text generation for a trained model: greedy or top-k sampling.

Recomputes the full (cropped) context each step instead of keeping a KV cache:
generation here is for samples and checks on small models. Serving (continuous
batching, KV cache) is not built yet; it is planned as ``raysc/serve/`` on vLLM in Ray
Serve (docs/architecture.md), above the model, never imported by training code.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from raysc.model.llama import Llama


@torch.no_grad()
def generate(
    model: Llama,
    prompt_ids: list[int],
    max_new_tokens: int,
    temperature: float = 0.0,
    top_k: int = 0,
    seed: int = 0,
    stop_id: int | Iterable[int] | None = None,
) -> list[int]:
    """Return the generated continuation (without the prompt), ended before the first of ``stop_id``
    (an id or several: a tokenizer's EOS and its generation config's others). temperature 0 means greedy."""
    stops = {stop_id} if isinstance(stop_id, int) else set(stop_id or ())
    if not prompt_ids:
        raise ValueError("the prompt encodes to no tokens; give a non-empty prompt")
    device = next(model.parameters()).device
    gen = torch.Generator(device=device).manual_seed(seed)
    ids = torch.tensor([prompt_ids], dtype=torch.long, device=device)
    out: list[int] = []
    was_training = model.training
    model.eval()
    for _ in range(max_new_tokens):
        logits = model(ids[:, -model.max_seq_len :])[0, -1].float()
        if temperature <= 0:
            nxt = int(logits.argmax())
        else:
            logits = logits / temperature
            if top_k:
                kth = torch.topk(logits, min(top_k, logits.numel())).values[-1]
                logits = logits.masked_fill(logits < kth, float("-inf"))
            nxt = int(torch.multinomial(torch.softmax(logits, -1), 1, generator=gen))
        if nxt in stops:
            break
        out.append(nxt)
        ids = torch.cat([ids, torch.tensor([[nxt]], device=device)], dim=1)
    model.train(was_training)
    return out
