"""The exchange precision of an SPMode (sp/strategies.py CompressedKV): exact stays bit for bit
the plain strategy; int8 / fp8 stay within the documented bound of exact on rank threads over
every backend, for allgather and ulysses, and move fewer bytes."""

import pytest
import torch

from comfy.multidevice.comm.compression import STEP_REL_ERROR_BOUND
from comfy.multidevice.miniature.h3 import build_miniature
from comfy.multidevice.sp.strategies import AllGatherKV, CompressedKV, make_kv_strategy, SPMode
from comfy.multidevice.sp.ulysses import UlyssesKV
from tests.sp_cases import FOUR_HEADS, frobenius_rel, run_sp

pytestmark = pytest.mark.timeout(180)


@pytest.fixture(scope="module")
def model():
    return build_miniature(FOUR_HEADS, seed=5)


@pytest.fixture(params=["peer", "hccl", "nccl"])
def backend(request):
    if request.param != "peer":
        request.getfixturevalue(f"use_fake_{request.param}")
    return request.param


def test_exact_is_the_plain_strategy_and_the_others_wrap_it():
    assert type(make_kv_strategy(SPMode("allgather"))) is AllGatherKV
    assert type(make_kv_strategy(SPMode("ulysses", exchange_precision="exact"))) is UlyssesKV
    wrapped = make_kv_strategy(SPMode("ulysses", exchange_precision="int8"))
    assert isinstance(wrapped, CompressedKV) and type(wrapped.strategy) is UlyssesKV and wrapped.name == "ulysses"
    with pytest.raises(ValueError, match="int8"):
        SPMode("allgather", exchange_precision="int4")


@pytest.mark.parametrize("mode", ["allgather", "ulysses"])
@pytest.mark.parametrize("world", [2, 4])
def test_int8_within_the_bound_of_exact_with_fewer_bytes(model, backend, mode, world):
    exact, _, exact_bytes = run_sp(model, world, backend, "plain", sp_mode=mode)
    same, _, _ = run_sp(model, world, backend, "plain", sp_mode=SPMode(mode, exchange_precision="exact"))
    assert all(torch.equal(a, b) for a, b in zip(same, exact))  # exact: bit for bit
    out, _, int8_bytes = run_sp(model, world, backend, "plain", sp_mode=SPMode(mode, exchange_precision="int8"))
    error = frobenius_rel(out, exact)
    assert 0 < error <= STEP_REL_ERROR_BOUND["int8"], (mode, world, error)
    # the forward's last gather of the rows is not compressed; the attention's exchanges are
    assert int8_bytes[0]["sent"] < 0.7 * exact_bytes[0]["sent"]


@pytest.mark.parametrize("mode", ["allgather", "ulysses"])
def test_fp8_within_its_bound(model, mode):
    exact, _, _ = run_sp(model, 4, "peer", "cond_refs", sp_mode=mode)
    out, _, _ = run_sp(model, 4, "peer", "cond_refs", sp_mode=SPMode(mode, exchange_precision="fp8"))
    assert 0 < frobenius_rel(out, exact) <= STEP_REL_ERROR_BOUND["fp8"]


def test_hybrid_and_overlap_compress_too(model):
    # 4 heads over 3 ranks: the hybrid (U = 1); over 2 ranks with 2 overlapped head chunks
    for world, sp_mode in ((3, SPMode("ulysses", exchange_precision="int8")),
                           (2, SPMode("ulysses", overlap_chunks=2, exchange_precision="int8"))):
        exact, _, _ = run_sp(model, world, "peer", "plain", sp_mode=SPMode(sp_mode.mode, sp_mode.overlap_chunks))
        out, _, _ = run_sp(model, world, "peer", "plain", sp_mode=sp_mode)
        assert 0 < frobenius_rel(out, exact) <= STEP_REL_ERROR_BOUND["int8"]


@pytest.mark.parametrize("backend", ["peer", "nccl"], indirect=True)
def test_int8_with_an_uneven_split_stays_within_the_bound(model, backend):
    """The two node inputs together: uneven rows (split 3,1,2) make the all-gather uneven and
    the compressed records must keep each rank's count; the bound holds as for the even split."""
    exact, sp, _ = run_sp(model, 3, backend, "cond_refs", split="3,1,2")
    assert len(set(sp.tokens_per_rank())) == 3  # three different shares
    out, _, _ = run_sp(model, 3, backend, "cond_refs", sp_mode=SPMode("allgather", exchange_precision="int8"),
                       split="3,1,2")
    assert 0 < frobenius_rel(out, exact) <= STEP_REL_ERROR_BOUND["int8"]
