"""Multi-device video VAE decode (comfy/multidevice/vae/chunked.py) on CPU ranks.

Chunked decode is compared with the decoder's own single-device decode bit for bit
(torch.equal: the same ops run on the same inputs, only on other rank threads).
Feathered windows are checked for exactness where windows agree, and for continuity
(bounded frame-to-frame change across every seam) where they do not.
"""

import pytest
import torch

from comfy.multidevice.weights.module_copies import replica_on
from comfy.multidevice.vae.chunked import (ChunkedDecode, H3ChunkSchedule, ParallelDecodeError, feather_weights, feather_windows, feathered_decode, linear_blend, with_parallel_decode)
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
    with pytest.raises(ParallelDecodeError, match="feathered_decode"):
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


# ----------------------------------------------------------------------------- feathering

def test_linear_blend_ramps_from_a_to_b():
    a = torch.zeros(1, 1, 6, 1, 1)
    b = torch.ones(1, 1, 8, 1, 1)
    out = linear_blend(a, b, 4)
    assert out.shape[2] == 8
    assert out[0, 0, :, 0, 0].tolist() == [0.0, 0.25, 0.5, 0.75, 1, 1, 1, 1]


def test_feather_windows_cover_the_output_end_aligned():
    causal = lambda n: 4 * n - 3  # noqa: E731
    wins = feather_windows(20, window=8, overlap=3, frames_for=causal)
    assert wins[0].latent == (0, 8) and wins[0].frames == (0, causal(8))
    assert wins[-1].latent[1] == 20 and wins[-1].frames[1] == causal(20)
    for prev, nxt in zip(wins, wins[1:]):
        assert nxt.frames[0] < prev.frames[1]  # every seam overlaps
    for i in range(len(wins)):  # neighbouring ramps sum to 1 over each overlap
        w = feather_weights(wins, i)
        assert w.min() > 0 and w.max() <= 1
    total = torch.zeros(causal(20), dtype=torch.float64)
    for i, win in enumerate(wins):
        total[win.frames[0]:win.frames[1]] += feather_weights(wins, i)
    assert torch.allclose(total, torch.ones_like(total))


def test_feathered_windows_exact_when_windows_agree():
    # A per-frame decoder (no temporal context): every window agrees with the full decode.
    proj = torch.nn.Conv3d(4, 3 * 4, kernel_size=1)

    def per_frame(device, z):
        out = proj(z)  # [B, 12, T, h, w] -> 4 frames per latent frame
        b, _, t, h, w = out.shape
        return out.view(b, 3, 4, t, h, w).permute(0, 1, 3, 2, 4, 5).reshape(b, 3, t * 4, h, w)

    z = latent(19, seed=2)
    with torch.no_grad():
        want = per_frame("cpu", z)
        got = feathered_decode(per_frame, z, ["cpu"] * 3, window=6, overlap=2, frames_for=lambda n: 4 * n)
    scale = want.abs().max()
    assert (got - want).abs().max() <= 1e-6 * scale


def ema_decoder(device, z, ratio=4):
    """A causal decoder with memory: frame t is an exponential average of latents <= t.

    Decoded alone, a window starts from an empty state, so it disagrees with its left
    neighbour at its start; the disagreement halves with every latent frame.
    """
    state = torch.zeros_like(z[:, :, 0])
    frames = []
    for t in range(z.shape[2]):
        state = 0.5 * state + 0.5 * z[:, :, t]
        frames.append(state)
    return torch.stack(frames, dim=2).repeat_interleave(ratio, dim=2)


def test_feathered_windows_are_continuous_across_seams():
    t = torch.arange(28, dtype=torch.float32).view(1, 1, -1, 1, 1)
    phase = torch.rand(1, 3, 1, 2, 2, generator=torch.Generator().manual_seed(4)) * 6
    z = 1.0 + torch.sin(t / 12 + phase)  # smooth in time, far from the empty state
    window, overlap = 8, 4
    frames_for = lambda n: 4 * n  # noqa: E731
    wins = feather_windows(z.shape[2], window, overlap, frames_for)
    got = feathered_decode(ema_decoder, z, ["cpu"] * 4, window=window, overlap=overlap,
                           frames_for=frames_for)
    parts = [ema_decoder("cpu", z[:, :, w.latent[0]:w.latent[1]]) for w in wins]
    n_out = got.shape[2]

    def steps(frames):  # per transition f -> f+1, the largest change over channels and pixels
        return (frames[:, :, 1:] - frames[:, :, :-1]).abs().amax(dim=(0, 1, 3, 4))

    # What the windows themselves do at each transition, and where seams are.
    own = torch.zeros(n_out - 1)
    seam = torch.zeros(n_out - 1, dtype=torch.bool)
    disagreement = 0.0
    for i, win in enumerate(wins):
        a, b = win.frames
        own[a:b - 1] = torch.maximum(own[a:b - 1], steps(parts[i]))
        if i + 1 < len(wins):
            b0 = wins[i + 1].frames[0]
            seam[b0 - 1:b] = True  # entering, inside and leaving the overlap
            d = (parts[i][:, :, b0 - a:] - parts[i + 1][:, :, :b - b0]).abs().max()
            disagreement = max(disagreement, float(d))
    ramp = overlap * 4 + 1  # overlap frames + 1: the weight changes by 1/ramp per frame
    assert disagreement > 0.3  # the windows really disagree on their overlaps

    # feathered: at every transition, the windows' own step plus at most disagreement / ramp
    bound = own + seam.float() * (disagreement / ramp) + 1e-6
    assert bool((steps(got) <= bound).all())

    # a hard cut in the middle of each overlap breaks that bound at the cut (placed inside a
    # latent frame's 4 output frames, where the windows themselves don't step)
    hard = got.clone()
    cuts = []
    for i in range(1, len(wins)):
        cut = (wins[i - 1].frames[1] + wins[i].frames[0]) // 2 + 2
        b0, b1 = wins[i].frames
        hard[:, :, cut:b1] = parts[i][:, :, cut - b0:]
        cuts.append(cut - 1)
    assert bool((steps(hard)[cuts] > bound[cuts]).all())

    # outside the overlaps each window's frames come through unchanged
    for i, win in enumerate(wins):
        a, b = win.frames
        lo = max(wins[i - 1].frames[1] - a, 0) if i > 0 else 0
        hi = b - a - (max(b - wins[i + 1].frames[0], 0) if i + 1 < len(wins) else 0)
        assert torch.allclose(got[:, :, a + lo:a + hi], parts[i][:, :, lo:hi], atol=1e-6)


def test_feathered_refuses_bad_windows():
    with pytest.raises(ParallelDecodeError, match="overlap < window"):
        feather_windows(10, window=4, overlap=4, frames_for=lambda n: n)
