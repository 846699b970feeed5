"""Ranks that share one memory attend in row pieces: together no more than one card's score blocks."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from comfy.multidevice.sp import attention_budget
from comfy.multidevice.sp.attention_budget import (attend_within_budget, rows_per_call,
                                                   score_block_bytes)

GIB = 2 ** 30


def plain_attention(q, k, v, heads, skip_reshape=False, skip_output_reshape=False):
    """softmax(q k^T / sqrt(d)) v in ComfyUI's calling convention (no chunks of its own)."""
    if not skip_reshape:
        b, n, _ = q.shape
        q, k, v = (t.view(b, t.shape[1], heads, -1).transpose(1, 2) for t in (q, k, v))
    scores = torch.softmax(q @ k.transpose(-1, -2) / q.shape[-1] ** 0.5, dim=-1)
    out = scores @ v  # [B, H, L, D]
    if skip_output_reshape:
        return out
    return out.transpose(1, 2).flatten(2)


def recording(fn, seen):
    def call(q, k, v, heads, **kwargs):
        seen.append(q.shape[2 if kwargs.get("skip_reshape") else 1])
        return fn(q, k, v, heads, **kwargs)
    return call


def test_the_ranks_score_blocks_together_stay_within_a_quarter_of_the_free_memory():
    for world, batch_heads, keys, free in [(4, 16, 109_952, 20 * GIB), (2, 56, 38_592, 3 * GIB), (8, 2, 500, 10**6)]:
        rows = rows_per_call(world, batch_heads, keys, free)
        assert world * score_block_bytes(batch_heads, rows, keys) <= free // attention_budget.FREE_SHARE
        assert world * score_block_bytes(batch_heads, rows + 1, keys) > free // attention_budget.FREE_SHARE - \
            world * score_block_bytes(batch_heads, 1, keys)  # and not needlessly small
    assert rows_per_call(4, 16, 10**9, 1) == 1  # never zero rows


@pytest.mark.parametrize("skip_reshape, skip_output_reshape", [(True, False), (True, True), (False, False)])
def test_row_pieces_give_the_rows_of_one_call(skip_reshape, skip_output_reshape):
    g = torch.Generator().manual_seed(0)
    b, h, n, keys, d = 1, 4, 37, 53, 16
    shape_q, shape_kv = ((b, h, n, d), (b, h, keys, d)) if skip_reshape else ((b, n, h * d), (b, keys, h * d))
    q, k, v = torch.randn(shape_q, generator=g), torch.randn(shape_kv, generator=g), torch.randn(shape_kv, generator=g)
    kw = dict(skip_reshape=skip_reshape, skip_output_reshape=skip_output_reshape)
    whole = plain_attention(q, k, v, h, **kw)
    seen = []
    cpu_rank = SimpleNamespace(world_size=2, device=torch.device("cpu"))
    pieces = attend_within_budget(cpu_rank, recording(plain_attention, seen), q, k, v, h, rows=8, **kw)
    assert seen == [8, 8, 8, 8, 5]
    assert pieces.shape == whole.shape
    # rows are independent: the same rows, up to the matmul's blocking for another row count
    assert torch.allclose(pieces, whole, rtol=1e-6, atol=1e-6), (pieces - whole).abs().max()


def test_cpu_ranks_attend_in_pieces_and_cards_in_one_call(monkeypatch):
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(1, 4, rows, 8, generator=g) for rows in (64, 256, 256))
    keys_bytes = score_block_bytes(4, 1, 256)
    # free memory for 4 ranks x 16 rows of 4 x 256 fp32 scores, times FREE_SHARE
    monkeypatch.setattr(attention_budget, "available_memory_bytes",
                        lambda: attention_budget.FREE_SHARE * 4 * 16 * keys_bytes)
    seen = []
    cpu_rank = SimpleNamespace(world_size=4, device=torch.device("cpu"))
    out = attend_within_budget(cpu_rank, recording(plain_attention, seen), q, k, v, 4, skip_reshape=True)
    assert seen == [16, 16, 16, 16]
    assert torch.allclose(out, plain_attention(q, k, v, 4, skip_reshape=True), rtol=1e-6, atol=1e-6)
    seen.clear()
    card_rank = SimpleNamespace(world_size=4, device=torch.device("cuda", 0))  # its own memory
    attend_within_budget(card_rank, recording(plain_attention, seen), q, k, v, 4, skip_reshape=True)
    assert seen == [64]
    seen.clear()
    alone = SimpleNamespace(world_size=1, device=torch.device("cpu"))  # one rank: upstream's own sizing
    attend_within_budget(alone, recording(plain_attention, seen), q, k, v, 4, skip_reshape=True)
    assert seen == [64]
