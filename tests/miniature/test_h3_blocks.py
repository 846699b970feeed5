"""The miniature's layers: the split-half RoPE rotates only part of the head."""

from __future__ import annotations

import torch

from comfy.multidevice.miniature.h3_blocks import apply_split_half_rope, rope_rotation_table


def test_rope_rotates_only_part_of_the_head():
    x = torch.randn(7, 2, 16)
    table = rope_rotation_table(torch.randn(7, 6), torch.float32)
    assert table.shape == (1, 7, 1, 6, 2, 2)
    y = apply_split_half_rope(x, table)
    assert torch.equal(y[..., 12:], x[..., 12:])
    assert torch.allclose(y[..., :12].norm(dim=-1), x[..., :12].norm(dim=-1), atol=1e-5)
    assert not torch.allclose(y[..., :12], x[..., :12])
