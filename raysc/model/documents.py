"""Document boundaries inside packed rows: which document each token is in, its position in it, and the
block-causal attention mask that keeps documents from seeing each other (``train.document_mask``).

raysc packs documents back to back, each ended by the tokenizer's EOS (``raysc.data.packing``), so a
row's boundaries are its EOS tokens: a token belongs to the document that the next EOS at or after it
ends, i.e. its document id is the number of EOS tokens strictly before it. A row that begins in the
middle of a document gives that fragment id 0. Ids are computed over the whole row, before context
parallelism cuts it into chunks, so every rank agrees on them.

The mask is an explicit boolean for ``scaled_dot_product_attention``, whose fused CPU kernel
(``_scaled_dot_product_flash_attention_for_cpu``) takes one; this is what torchtitan's block-causal
FlexAttention mask and Megatron's ``--reset-attention-mask`` compute. Not FlexAttention itself: it needs
``torch.compile`` (seconds of start-up per process, and on CPU a C++ toolchain), and an explicit mask is
what context parallelism's kernel (``raysc.parallel.cp``) already takes. A masked kernel computes every
query-key tile (its causal flag skips those above the diagonal; a mask cannot), so ``document_mask``
picks the cheapest exact form per forward: plain causal when no row of the batch holds a boundary, the
whole ``(batch, 1, seq, seq)`` mask for short rows, and for long rows ``QueryBlocks``: query blocks of
``BLOCK`` tokens, each against the keys from the earliest start of its documents to its own end, which
skips the tiles above the diagonal and those of earlier documents.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def document_ids(tokens: torch.Tensor, eos_id: int) -> torch.Tensor:
    """(batch, seq) ids: the number of EOS tokens before each position of its row (an EOS ends its own
    document, so it carries the id of the tokens before it)."""
    eos = (tokens == eos_id).to(torch.int32)
    return torch.cumsum(eos, dim=1, dtype=torch.int32) - eos


def positions_in_document(documents: torch.Tensor) -> torch.Tensor:
    """(batch, seq) each token's position inside its document (0 at the first token after an EOS, and at
    the row's first token)."""
    return torch.arange(documents.shape[1], device=documents.device) - document_starts(documents)


def document_starts(documents: torch.Tensor) -> torch.Tensor:
    """(batch, seq) the position where each token's document begins in its row (0 for the row's first)."""
    index = torch.arange(documents.shape[1], device=documents.device).expand_as(documents)
    starts = torch.ones_like(documents, dtype=torch.bool)
    starts[:, 1:] = documents[:, 1:] != documents[:, :-1]
    return torch.cummax(torch.where(starts, index, torch.zeros_like(index)), dim=1).values


def block_causal_mask(
    documents: torch.Tensor, query_positions: torch.Tensor, first_key: int = 0, end_key: int | None = None
) -> torch.Tensor:
    """(batch, 1, len(query_positions), keys) boolean mask, True where the query at that absolute position
    may attend: keys at or before it in the same document. ``documents`` covers the whole row; the
    queries may be a subset of it (a context-parallel rank's chunks, a query block), the keys the row's
    positions ``first_key .. end_key - 1`` (default all)."""
    end_key = documents.shape[1] if end_key is None else end_key
    keys = torch.arange(first_key, end_key, device=documents.device)
    causal = query_positions[:, None] >= keys[None, :]
    same = documents[:, query_positions, None] == documents[:, None, first_key:end_key]
    return (causal[None] & same).unsqueeze(1)


BLOCK = 256  # query block of ``QueryBlocks``; rows of at least two blocks are cut


class QueryBlocks:
    """The block-causal attention of one forward over whole rows, as query blocks: block ``[start, end)``
    attends to keys ``[first, end)`` (``first``: the earliest start of a document among its queries) under
    its slice of the mask. Exact: every key a query may see lies in its block's range."""

    def __init__(self, documents: torch.Tensor, block: int = BLOCK) -> None:
        seq = documents.shape[1]
        starts = document_starts(documents)
        self.blocks: list[tuple[int, int, int, torch.Tensor]] = []
        for start in range(0, seq, block):
            end = min(seq, start + block)
            first = int(starts[:, start].min())  # starts only grow along a row: its block's first query has it
            queries = torch.arange(start, end, device=documents.device)
            self.blocks.append((start, end, first, block_causal_mask(documents, queries, first, end)))

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None) -> torch.Tensor:
        """Attention of (batch, heads, seq, head_dim) q/k/v (k, v with q's head count)."""
        return torch.cat(
            [
                F.scaled_dot_product_attention(
                    q[:, :, s:e], k[:, :, first:e], v[:, :, first:e], attn_mask=mask, scale=scale
                )
                for s, e, first, mask in self.blocks
            ],
            dim=2,
        )


def document_mask(documents: torch.Tensor, query_positions: torch.Tensor | None) -> torch.Tensor | QueryBlocks | None:
    """The attention mask of a forward with ``documents``: None (plain causal) when no row of the batch
    crosses a boundary and the queries are the whole row; ``QueryBlocks`` for whole rows of at least two
    blocks; else the mask of ``query_positions`` (default: the whole row) over the whole row."""
    whole = query_positions is None
    if whole and bool((documents[:, -1] == documents[:, 0]).all()):
        return None
    if whole and documents.shape[1] >= 2 * BLOCK:
        return QueryBlocks(documents)
    queries = torch.arange(documents.shape[1], device=documents.device) if whole else query_positions
    return block_causal_mask(documents, queries)
