"""H3's projection-only costs (bench/h3_costs.py): FLOPs per forward and per-block parameters."""

from bench.h3_costs import block_parameters, forward_flops
from comfy.multidevice.sp.cost_model import DiTShape


def test_flops_of_h3_are_mostly_attention_at_15_seconds():
    flops = forward_flops(DiTShape(), 109_062)
    # per token per block: 2 * 5376 * (3*7168 + 7168 + 2*14336 + 14336) multiply-adds
    assert flops["linear"] == 2 * 5376 * 71680 * 109_062 * 50
    assert 0.79 < flops["attention"] / flops["total"] < 0.81  # docs/ARCHITECTURE.md: ~80%


def test_block_parameters_of_h3_count_linears_adaln_and_norms():
    h, a, f = 5376, 56 * 128, 14336
    linear = h * 3 * a + a * h + h * 2 * f + f * h
    assert block_parameters(DiTShape()) == linear + 6 * h * 3 * (2688 + 1) + 2 * h + 2 * 128
