"""Multi-device video VAE decode (comfy/multidevice/vae/chunked.py) on CPU ranks.

Chunked decode is compared with the decoder's own single-device decode bit for bit
(torch.equal: the same ops run on the same inputs, only on other rank threads).
"""

import pytest
import torch

from comfy.multidevice.weights.module_copies import replica_on
from comfy.multidevice.vae.chunked import (ChunkedDecode, H3ChunkSchedule, ParallelDecodeError, linear_blend, with_parallel_decode)
from comfy.multidevice.comm.group import SequenceParallelCoordinator
from tests.small_vaes import TinyCausalDecoder, TinyCausalVideoVAE

pytestmark = pytest.mark.timeout(120)


def latent(t, seed=0, b=1, c=4, h=3, w=5):
    return torch.randn(b, c, t, h, w, generator=torch.Generator().manual_seed(seed))


# ----------------------------------------------------------------------------- schedule

def test_h3_schedule_numbers_match_upstream_facts():
    s = H3ChunkSchedule()  # clip 17, ratio 4, token_drop 3
    assert (s.chunk_latents, s.overlap_latents, s.lead_in, s.blend_frames) == (5, 2, 3, 5)
    p = s.plan(37)  # 1344x768, 124 frames (5 s) -> 37 latent frames
    assert p.output_frames == 124 and p.pad_latents == 0
    assert p.windows == tuple((5 * i, 5 * i + 7) for i in range(7))
    assert (p.body, p.tail) == ((3, 20), (23, 28))
    assert s.plan(107).output_frames == 362  # 15 s


@pytest.mark.parametrize("k", range(0, 8))
def test_valid_lengths_decode_to_17k_plus_5(k):
    assert H3ChunkSchedule().plan(5 * k + 2).output_frames == 17 * k + 5


@pytest.mark.parametrize("t", [2, 3, 4, 5, 6, 7, 8, 11, 12, 13, 17, 23])
def test_plan_frames_equal_the_reference_output_shape(t):
    vae = TinyCausalVideoVAE()
    assert H3ChunkSchedule().plan(t).output_frames == vae.decode_output_shape((1, 4, t, 3, 5))[2]


def test_plan_refuses_a_single_frame():
    with pytest.raises(ParallelDecodeError, match="at least 2 latent frames"):
        H3ChunkSchedule().plan(1)


# ----------------------------------------------------------------------------- chunked decode

@pytest.mark.parametrize("world", [1, 2, 3, 4])
@pytest.mark.parametrize("t", [2, 4, 7, 12, 17])
def test_chunked_decode_is_bit_identical_to_single_device(world, t):
    vae = TinyCausalVideoVAE(seed=t)
    z = latent(t, seed=world)
    with torch.no_grad():
        want = vae.decode(z)
        got = ChunkedDecode(vae, ["cpu"] * world).decode(z)
    assert got.shape == want.shape
    assert torch.equal(got, want)


def test_chunked_decode_fills_the_preallocated_buffer_and_matches():
    vae = TinyCausalVideoVAE(seed=3)
    z = latent(22, seed=3, b=2)
    with torch.no_grad():
        want = vae.decode(z)
        buf = torch.full(vae.decode_output_shape(z.shape), float("nan"))
        with SequenceParallelCoordinator(["cpu"] * 4, timeout_s=60) as coord:
            out = ChunkedDecode(vae, coord.devices, runner=coord).decode(z, output_buffer=buf)
    assert out is buf
    assert torch.equal(buf, want)


def test_a_wrong_output_buffer_is_refused_before_any_chunk_is_decoded():
    vae = TinyCausalVideoVAE()
    calls = []
    real = vae._adaptive_decode
    vae._adaptive_decode = lambda z: calls.append(1) or real(z)
    z = latent(12)
    frames = vae.decode_output_shape(z.shape)[2]
    buf = torch.empty(1, 3, frames - 1, 6, 10)
    with pytest.raises(ParallelDecodeError, match=f"output_buffer has {frames - 1} frames.*gives {frames}"):
        ChunkedDecode(vae, ["cpu"] * 2).decode(z, output_buffer=buf)
    assert calls == []


def test_merge_releases_each_raw_chunk_and_writes_into_the_buffer():
    # The merge streams: every raw chunk is let go once merged, and the finished frames go
    # into the caller's buffer, never into a second full-size copy of the video.
    vae = TinyCausalVideoVAE(seed=4)
    z = latent(17, seed=4)
    decoder = ChunkedDecode(vae, ["cpu"] * 3)
    plan = decoder.interface.schedule.plan(z.shape[2])
    with torch.no_grad():
        raw_parts = decoder.decode_chunks(z, plan)
        buf = torch.full(vae.decode_output_shape(z.shape), float("nan"))
        out = decoder.merge(raw_parts, plan, buf)
        want = vae.decode(z)
    assert out is buf and torch.equal(buf, want)
    assert raw_parts == [None] * len(plan.windows)


def test_chunks_are_spread_over_all_ranks():
    vae = TinyCausalVideoVAE()
    seen = []
    real = vae._adaptive_decode

    def spy(z):
        import threading
        seen.append(threading.current_thread().name)
        return real(z)

    vae._adaptive_decode = spy
    with torch.no_grad():
        ChunkedDecode(vae, ["cpu"] * 4).decode(latent(37))
    assert len(seen) == 7
    assert sorted(set(seen)) == [f"sp-rank-{r}" for r in range(4)]


def test_the_merge_card_decodes_with_the_module_itself_never_a_copy():
    """On the merge card the module decodes as its model manager left it there (ComfyUI's VAE
    patcher counts those weights); the copy cache is asked only for the other cards, even when
    it would build a copy for the merge card (the module's first weight elsewhere, as after a
    partial load). Here every rank is the merge device: no copy is asked for at all."""
    vae = TinyCausalVideoVAE(seed=3)
    asked, decoded_by = [], []

    class CopyingCache:  # what ReplicaCache does when the module's home is another device
        def get(self, device):
            asked.append(device)
            return replica_on(vae, device)

    real = vae._adaptive_decode
    vae._adaptive_decode = lambda z: decoded_by.append("module") or real(z)
    z = latent(17, seed=5)
    chunked = ChunkedDecode(vae, ["cpu"] * 3, merge_device="cpu", replicas=CopyingCache())
    chunks = len(chunked.interface.schedule.plan(17).windows)
    with torch.no_grad():
        want = vae.decode(z)
        decoded_by.clear()
        got = chunked.decode(z)
    assert chunks == 3 and asked == [] and decoded_by == ["module"] * chunks  # all by the module
    assert torch.equal(got, want)


def test_single_frame_uses_the_module_path():
    vae = TinyCausalVideoVAE()
    z = latent(1)
    with torch.no_grad():
        assert torch.equal(ChunkedDecode(vae, ["cpu"] * 2).decode(z), vae.decode(z))


def test_with_parallel_decode_leaves_the_module_untouched():
    vae = TinyCausalVideoVAE(seed=5)
    z = latent(12, seed=5)
    clone = with_parallel_decode(vae, ["cpu"] * 3)
    assert "decode" not in vae.__dict__  # the original keeps its own decode
    assert clone.decoder is vae.decoder  # weights shared, not copied
    with torch.no_grad():
        assert torch.equal(clone.decode(z), vae.decode(z))


def test_a_changed_schedule_is_refused_not_merged_wrong():
    vae = TinyCausalVideoVAE()
    vae.decode_output_shape = lambda shape: (1, 3, 999, 6, 10)
    with pytest.raises(ParallelDecodeError, match="decode on one device"):
        ChunkedDecode(vae, ["cpu"] * 2).decode(latent(7))


def test_a_decoder_without_chunk_interface_is_refused():
    with pytest.raises(ParallelDecodeError, match="decode it on one device"):
        ChunkedDecode(TinyCausalDecoder(), ["cpu"])


def test_a_failing_rank_raises_on_the_caller_without_hanging():
    vae = TinyCausalVideoVAE()
    real = vae._adaptive_decode
    calls = []

    def flaky(z):
        calls.append(1)
        if len(calls) == 3:
            raise RuntimeError("simulated device failure")
        return real(z)

    vae._adaptive_decode = flaky
    with pytest.raises(RuntimeError, match="simulated device failure"):
        ChunkedDecode(vae, ["cpu"] * 4).decode(latent(37))


def test_replica_on_copies_weights_to_the_device():
    dec = TinyCausalDecoder()
    rep = replica_on(dec, torch.device("cpu"))
    assert rep is not dec
    for (n, p), (_, q) in zip(dec.named_parameters(), rep.named_parameters()):
        assert torch.equal(p, q) and p.data_ptr() != q.data_ptr(), n


# ----------------------------------------------------------------------------- blend

def test_linear_blend_ramps_from_a_to_b():
    a = torch.zeros(1, 1, 6, 1, 1)
    b = torch.ones(1, 1, 8, 1, 1)
    out = linear_blend(a, b, 4)
    assert out.shape[2] == 8
    assert out[0, 0, :, 0, 0].tolist() == [0.0, 0.25, 0.5, 0.75, 1, 1, 1, 1]
