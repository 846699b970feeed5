"""The sequence-parallel cost model (comfy/multidevice/sp/cost_model.py); the H3 projection built on
it (bench/project_h3.py) is tested in tests/bench/test_project_h3.py.

The byte formulas are checked here for their algebra (closed forms, conservation, the
allgather/ulysses relations); tests/sp/test_ulysses.py checks them against the byte counters of
real runs of the miniature.
"""

import pytest

from comfy.multidevice.sp.cost_model import (DiTShape, attention_traffic, final_layer_traffic,
                                             forward_flops, forward_traffic, h3_targets,
                                             hidden_gather_traffic, Traffic, ulysses_degree)


def test_ulysses_degree_is_the_largest_common_divisor_group():
    assert [ulysses_degree(w, 56) for w in range(1, 9)] == [1, 2, 1, 4, 1, 2, 7, 8]
    assert ulysses_degree(4, 2) == 2 and ulysses_degree(6, 4) == 2 and ulysses_degree(3, 4) == 1
    with pytest.raises(ValueError, match="heads >= 1"):
        ulysses_degree(4, 0)


@pytest.mark.parametrize("world", [2, 4, 7, 8])
def test_closed_forms_when_everything_divides(world):
    seq, heads, dim, item = 56 * 8 * 3, 56, 128, 2
    unit = seq * heads * dim * item
    for rank in range(world):
        ag = attention_traffic("allgather", seq, world, rank, heads, dim, item)
        ul = attention_traffic("ulysses", seq, world, rank, heads, dim, item)
        assert ag.received == 2 * unit * (world - 1) // world
        assert ul.received == 4 * unit * (world - 1) // world ** 2  # q, k, v in + out back
        assert ag.sent == ag.received and ul.sent == ul.received


@pytest.mark.parametrize("world,heads", [(3, 4), (4, 4), (4, 2), (6, 4), (5, 7), (8, 56)])
@pytest.mark.parametrize("seq", [11, 97, 1000])
def test_what_ranks_send_the_others_receive(world, heads, seq):
    if seq < world:
        pytest.skip("fewer rows than ranks")
    for mode in ("allgather", "ulysses"):
        flows = [attention_traffic(mode, seq, world, r, heads, 8, 4) for r in range(world)]
        assert sum(f.sent for f in flows) == sum(f.received for f in flows)


def test_degree_one_is_exactly_allgather():
    for rank in range(3):
        assert attention_traffic("ulysses", 100, 3, rank, 5, 16, 2, degree=1) == \
            attention_traffic("allgather", 100, 3, rank, 5, 16, 2)


def test_one_rank_moves_nothing_and_bad_modes_are_named():
    assert attention_traffic("ulysses", 10, 1, 0, 4, 8, 4).received == 0
    with pytest.raises(ValueError, match="'ring'"):
        attention_traffic("ring", 10, 2, 0, 4, 8, 4)
    with pytest.raises(ValueError, match="degree 3 does not divide"):
        attention_traffic("ulysses", 10, 4, 0, 6, 8, 4, degree=3)


def test_flops_of_h3_are_mostly_attention_at_15_seconds():
    flops = forward_flops(DiTShape(), 109_062)
    # per token per block: 2 * 5376 * (3*7168 + 7168 + 2*14336 + 14336) multiply-adds
    assert flops["linear"] == 2 * 5376 * 71680 * 109_062 * 50
    assert 0.79 < flops["attention"] / flops["total"] < 0.81  # docs/ARCHITECTURE.md: ~80%


def test_forward_traffic_adds_the_rank_local_final_rows():
    shape = DiTShape(hidden=10, blocks=3, heads=2, head_dim=4, ffn=8, video_out=6, audio_out=2)
    targets = h3_targets(shape, 7, video_rows=3, audio_rows=2)  # rows 2..4 audio, 4..7 video
    assert targets == ((4, 7, 6), (2, 4, 2))
    t = forward_traffic("allgather", shape, 7, 2, 1, targets, itemsize=4)  # rank 1 owns rows 3..7
    assert t["final_gather"] == Traffic(sent=(3 * 6 + 1 * 2) * 4, received=0)  # all to rank 0
    assert forward_traffic("allgather", shape, 7, 2, 0, targets, itemsize=4)["final_gather"] == \
        Traffic(sent=0, received=(3 * 6 + 1 * 2) * 4)
    everyone = forward_traffic("allgather", shape, 7, 2, 1, targets, itemsize=4, final_rows_to="all")
    assert everyone["final_gather"] == Traffic(sent=(3 * 6 + 1 * 2) * 4, received=1 * 2 * 4)
    assert t["total"].received == t["attention"].received + t["final_gather"].received
    assert t["attention"].received == 3 * attention_traffic("allgather", 7, 2, 1, 2, 4, 4).received


@pytest.mark.parametrize("world", [2, 4, 8])
def test_final_rows_are_at_least_forty_times_fewer_bytes_than_the_hidden_gather_at_h3_width(world):
    """15 s at 768p: 107,856 video and 1,206 audio rows behind ~890 text rows (bf16 hidden)."""
    shape, video, audio = DiTShape(), 107_856, 1_206
    seq = video + audio + 890
    targets = h3_targets(shape, seq, video, audio)
    new = sum(final_layer_traffic(targets, seq, world, r).received for r in range(world))
    old = sum(hidden_gather_traffic(shape, seq, world, r).received for r in range(world))
    assert new * 40 <= old
    assert new == (world - 1) * 0 + sum(  # rank 0 receives every other rank's projected rows
        max(0, min(b, seq * (r + 1) // world) - max(a, seq * r // world)) * c * 4
        for a, b, c in targets for r in range(1, world))
