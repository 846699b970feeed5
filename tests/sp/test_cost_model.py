"""The sequence-parallel cost model (comfy/multidevice/sp/cost_model.py); the H3 projection built on
it (bench/project_h3.py, bench/h3_costs.py) is tested in tests/bench/.

The byte formulas are checked here for their algebra (closed forms, conservation, the
allgather/ulysses relations); tests/sp/test_ulysses.py checks them against the byte counters of
real runs of the miniature.
"""

import pytest

from comfy.multidevice.sp.cost_model import (DiTShape, attention_traffic, forward_traffic,
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


def test_forward_traffic_adds_the_hidden_state_gather_before_the_final_layer():
    shape = DiTShape(hidden=10, blocks=3, heads=2, head_dim=4, ffn=8)
    t = forward_traffic("allgather", shape, 7, 2, 1, itemsize=4)  # rank 1 owns rows 3..7
    assert t["final_gather"] == Traffic(sent=4 * 10 * 4, received=3 * 10 * 4)  # every rank gets all rows
    assert t["final_gather"] == hidden_gather_traffic(shape, 7, 2, 1, itemsize=4)
    assert forward_traffic("allgather", shape, 7, 1, 0, itemsize=4)["final_gather"] == Traffic(0, 0)
    assert t["total"].received == t["attention"].received + t["final_gather"].received
    assert t["attention"].received == 3 * attention_traffic("allgather", 7, 2, 1, 2, 4, 4).received


def test_uneven_weights_count_the_largest_share_and_each_ranks_own_rows():
    from comfy.multidevice.sp.cost_model import activation_bytes, attention_traffic, DiTShape, row_bytes
    shape = DiTShape()
    even = activation_bytes(shape, 1000, 2)
    assert activation_bytes(shape, 1000, 2, weights=(1, 1)) == even
    # 1 + floor(998 * 3/4) = 749 rows on the fast rank, 500 with the even split
    assert activation_bytes(shape, 1000, 2, weights=(3, 1)) - even == (749 - 500) * row_bytes(shape)
    fast = attention_traffic("allgather", 1000, 2, 0, 4, 8, 2, weights=(3, 1))
    slow = attention_traffic("allgather", 1000, 2, 1, 4, 8, 2, weights=(3, 1))
    assert fast.received == slow.sent and fast.sent == slow.received and fast.sent / slow.sent == 749 / 251


def test_a_compressed_exchange_counts_its_records_beside_the_decoded_tensors():
    from comfy.multidevice.sp.cost_model import activation_bytes, exchanged_bytes
    shape = DiTShape()  # H3: 56 heads x 128
    for mode in ("allgather", "ulysses"):
        exact = activation_bytes(shape, 109_952, 4, mode=mode)
        values = exchanged_bytes(shape, 109_952, 4, 2, mode) // 2
        for precision in ("int8", "fp8"):
            # one byte per value and a 2-byte scale per 128 values
            assert activation_bytes(shape, 109_952, 4, mode=mode, precision=precision) - exact == values * 130 // 128
    assert activation_bytes(shape, 109_952, 1, precision="int8") == activation_bytes(shape, 109_952, 1)
