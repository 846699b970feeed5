"""The memory plan (roles/memory_plan.py) and dit_weights through the node's configure_parallel.

Sizes are the objects' own tensor bytes; free memory is given per device name (CPU ranks have
no free-memory figure, so these tests pass it in). `shard` against `replicate` through the
node: bit-identical (torch.equal).
"""

from __future__ import annotations

import logging

import pytest
import torch

from comfy.multidevice.roles import apply as roles_apply
from comfy.multidevice.roles.memory_plan import (IN_FLIGHT_BLOCKS, MemoryPlanError, dit_shape_of,
                                                 plan_memory)
from comfy.multidevice.roles.plan import plan_roles
from comfy.multidevice.sp.cost_model import activation_bytes
from comfy_extras.nodes_multinpu import configure_parallel
from tests.sp_cases import make_inputs, tiny_model
from tests.node_cases import FakeModelPatcher, inputs, run_dit
from comfy.multidevice.comm.group import SequenceParallelCoordinator
from comfy.multidevice.tp.clip import tensor_parallel_clip
from comfy.multidevice.tensor_bytes import storage_bytes
from tests.tp.tp_cases import WrappedWeight

pytestmark = pytest.mark.usefixtures("close_coordinators")

CPU4 = [torch.device("cpu")] * 4
TOKENS = 1000


def nbytes(module) -> int:
    return sum(t.nbytes for t in module.state_dict().values())


def test_dit_stage_counts_the_weights_and_the_activation_estimate():
    model, clip, video, audio = inputs()
    dit = model.model.diffusion_model
    memory = plan_memory(plan_roles(4), CPU4, model, clip, video, audio, dit_weights="replicate", tokens=TOKENS)
    act = activation_bytes(dit_shape_of(dit), TOKENS, 4)
    assert act > 0
    for card in memory.cards:
        assert card.stages["DiT"] == {"weights": nbytes(dit), "activations": act}
        assert card.free is None  # CPU: not checked
    assert memory.problems() == [] and memory.dit_weights == "replicate"

    shard = plan_memory(plan_roles(4), CPU4, model, clip, video, audio, dit_weights="shard", tokens=TOKENS)
    blocks = sum(nbytes(b) for b in dit.blocks)
    largest = max(nbytes(b) for b in dit.blocks)
    owned = [c.stages["DiT"]["own blocks"] for c in shard.cards]
    assert sum(owned) == blocks
    for card in shard.cards:
        items = card.stages["DiT"]
        assert items["non-block weights"] == nbytes(dit) - blocks
        assert items["gathered blocks"] == IN_FLIGHT_BLOCKS * largest
        assert card.stage_total("DiT") < nbytes(dit) + act


def test_other_servers_ranks_share_the_sequence_and_the_blocks():
    """Ranks as processes with 2 ranks of other servers beside this server's 2 cards: W = 4 for
    the activations and the block shards, so each card plans 1/4 of the blocks."""
    model, clip, video, audio = inputs()
    dit = model.model.diffusion_model
    plan = plan_roles(2, remote_ranks=2)
    shard = plan_memory(plan, CPU4[:2], model, clip, video, audio, dit_weights="shard", tokens=TOKENS,
                        remote_ranks=2)
    alone = plan_memory(plan_roles(4), CPU4, model, clip, video, audio, dit_weights="shard", tokens=TOKENS)
    assert [c.stages["DiT"] for c in shard.cards] == [c.stages["DiT"] for c in alone.cards[:2]]
    assert shard.cards[0].stages["DiT"]["activations"] == activation_bytes(dit_shape_of(dit), TOKENS, 4)


def test_ulysses_at_8_cards_plans_less_per_card_than_the_allgather_by_the_exchange_it_holds():
    """At H3's sizes (56 heads x 128, 768p 15 s) the all-gather holds the full K and V per block,
    Ulysses a head block of q, k, v and the output and its own rows' K and V packed to send: the
    plan of the mode that runs counts that."""
    from comfy.multidevice.sp.cost_model import DiTShape, exchanged_bytes
    from comfy.multidevice.sp.mode_choice import choose_sp_mode
    h3, tokens = DiTShape(), 109_952
    for world in (4, 8):
        ulysses = choose_sp_mode("ulysses", world, h3.heads)
        saved = activation_bytes(h3, tokens, world) - activation_bytes(h3, tokens, world, mode="ulysses",
                                                                        degree=ulysses.degree)
        assert saved == exchanged_bytes(h3, tokens, world) - exchanged_bytes(h3, tokens, world, mode="ulysses")
        # received: a head block of q, k, v and out; sent: K and V of its rows, packed
        assert exchanged_bytes(h3, tokens, world, mode="ulysses") == 6 * tokens * h3.attention_width * 2 // world
    assert exchanged_bytes(h3, tokens, 8) / 2 ** 30 == pytest.approx(2.94, abs=0.01)  # the docs' figures
    assert exchanged_bytes(h3, tokens, 8, mode="ulysses") / 2 ** 30 == pytest.approx(1.10, abs=0.01)
    # through the plan: a 4-head miniature at 8 CPU ranks (the hybrid, 2 groups of 4) and at 4 (ulysses)
    import dataclasses

    from comfy.multidevice.miniature.h3 import build_miniature
    from tests.sp_cases import TINY
    model, clip, video, audio = inputs()
    model = FakeModelPatcher(build_miniature(dataclasses.replace(TINY, num_attention_heads=4)))
    for world, choice in ((4, "ulysses"), (8, "hybrid")):
        mode = choose_sp_mode(choice, world, 4)
        plans = {m.mode: plan_memory(plan_roles(world), [torch.device("cpu")] * world, model, clip, video, audio,
                                     dit_weights="replicate", tokens=4096, sp_mode=m)
                 for m in (mode, choose_sp_mode("allgather", world, 4))}
        assert plans["ulysses"].sp_mode == "ulysses" and plans["allgather"].sp_mode == "allgather"
        less = [a.stage_total("DiT") - u.stage_total("DiT")
                for a, u in zip(plans["allgather"].cards, plans["ulysses"].cards)]
        assert all(d > 0 for d in less), less
        # a prompt's own length is counted for the same mode
        assert plans["ulysses"].for_tokens(2048).cards[0].stages["DiT"]["activations"] == activation_bytes(
            dit_shape_of(model.model.diffusion_model), 2048, world, mode="ulysses", degree=mode.degree)


@pytest.mark.parametrize("world", [4, 8])  # 8: KV heads replicated (the miniature has 2)
def test_text_encoder_share_is_what_the_built_shards_and_the_clip_hold(world):
    # Planned before anything is built; then the split apply makes, counted: each rank's shard
    # (no embedding: the CLIP embeds) and, on rank 0's card, what the CLIP's patcher loads there
    # (the new CLIP's module: the embedding and the vision tower, no language model layers).
    model, clip, video, audio = inputs()
    cpus = [torch.device("cpu")] * world
    memory = plan_memory(plan_roles(world), cpus, model, clip, video, audio, tokens=TOKENS)
    planned = [c.stages["text encoder"] for c in memory.cards]
    with SequenceParallelCoordinator(cpus, backend="peer", timeout_s=30) as coord:
        parallel = tensor_parallel_clip(clip, coord)
        split = parallel.cond_stage_model.qwen3vl_32b.transformer.model
        built = [storage_bytes(s) for s in split.shards]
    assert [p["shard"] for p in planned] == built
    assert planned[0]["CLIP module"] == nbytes(parallel.cond_stage_model) > 0
    assert all("CLIP module" not in p for p in planned[1:])
    decoder = clip.cond_stage_model.qwen3vl_32b.transformer.model
    embedding, whole = nbytes(decoder.embed_tokens), nbytes(clip.cond_stage_model)
    assert planned[0]["CLIP module"] == whole - nbytes(decoder) + embedding
    # the old estimate (1/W of the whole CLIP) was off by the embedding and the vision tower on
    # card 0 and by the replicated norms everywhere; what the cards hold together now:
    assert sum(sum(p.values()) for p in planned) == nbytes(parallel.cond_stage_model) + sum(built)


def test_the_clip_load_card_is_refused_first_and_the_message_names_the_fix():
    # Card 0 holds rank 0's shard and the CLIP's own module: with the same free memory on every
    # card, it alone does not fit (the old 1/W share fitted on all four).
    model, clip, video, audio = inputs()
    memory = plan_memory(plan_roles(4), CPU4, model, clip, video, audio, tokens=TOKENS)
    need = [c.stage_total("text encoder") for c in memory.cards]
    assert need[0] > need[1] == need[2] == need[3]
    old_share = nbytes(clip.cond_stage_model) // 4
    for card in memory.cards:
        card.free = need[0] - 1
        card.stages = {"text encoder": card.stages["text encoder"]}  # this stage alone
    assert old_share <= need[0] - 1
    assert [(memory.cards.index(c), stage) for c, stage, _ in memory.problems()] == [(0, "text encoder")]
    with pytest.raises(MemoryPlanError) as err:
        memory.check()
    text = str(err.value)
    assert "cannot hold the text encoder stage" in text and "CLIP module" in text and "shard" in text
    assert "NVFP4 text encoder file or raise npu_count" in text


def test_text_encoder_share_and_vae_copies_follow_what_apply_will_do():
    model, clip, video, audio = inputs()
    te = sum(t.nbytes for t in clip.cond_stage_model.state_dict().values())
    memory = plan_memory(plan_roles(4), CPU4, model, clip, video, audio, tokens=TOKENS)
    assert [sorted(c.stages["text encoder"]) for c in memory.cards] == [["CLIP module", "shard"]] + [["shard"]] * 3
    assert all("video VAE" in c.stages["VAE decode"] for c in memory.cards)  # a copy per chunk card
    assert "audio VAE" in memory.cards[3].stages["VAE decode"]
    # a quantized encoder cannot be sliced: apply keeps it whole on card 0, and so does the plan
    proj = clip.cond_stage_model.qwen3vl_32b.transformer.model.layers[0].mlp.up_proj
    proj.weight = torch.nn.Parameter(proj.weight.detach().as_subclass(WrappedWeight), requires_grad=False)
    memory = plan_memory(plan_roles(4), CPU4, model, clip, video, audio, tokens=TOKENS)
    assert memory.cards[0].stages["text encoder"]["weights"] == te
    assert all("text encoder" not in c.stages for c in memory.cards[1:])


def test_auto_shards_only_when_a_replica_does_not_fit():
    model, clip, video, audio = inputs()
    dit = model.model.diffusion_model
    act = activation_bytes(dit_shape_of(dit), TOKENS, 4)
    replica_stage = nbytes(dit) + act
    roomy = {"cpu": replica_stage + 1}
    tight = {"cpu": replica_stage - 1}
    plan = plan_roles(4)
    assert plan_memory(plan, CPU4, model, clip, video, audio, tokens=TOKENS, free=roomy).dit_weights == "replicate"
    assert plan_memory(plan, CPU4, model, clip, video, audio, tokens=TOKENS, free=tight).dit_weights == "shard"
    assert plan_memory(plan, CPU4, model, clip, video, audio, tokens=TOKENS).dit_weights == "replicate"  # unknown
    # one card: nothing to shard across
    assert plan_memory(plan_roles(1), CPU4[:1], model, clip, video, audio, tokens=TOKENS,
                       free=tight).dit_weights == "replicate"


def test_a_plan_that_does_not_fit_is_refused_before_anything_is_touched(fake_patcher_extension, caplog):  # noqa: F811
    model, clip, video, audio = inputs()
    dit = model.model.diffusion_model
    before = {n: t.clone() for n, t in dit.state_dict().items()}
    caplog.set_level(logging.INFO)
    with pytest.raises(MemoryPlanError) as err:
        configure_parallel(model, clip, video, audio, npu_count=4, device_kind="cpu",
                           dit_weights="replicate", plan_tokens=TOKENS, free_memory={"cpu": nbytes(dit) // 2})
    text = str(err.value)
    assert "cpu cannot hold the DiT stage" in text and "GiB free" in text
    assert "INT8 DiT file" in text and "set dit_weights to shard" in text and f"plan_tokens (now {TOKENS})" in text
    assert "\n" not in text and "memory plan (dit_weights=replicate" in err.value.table  # the table: on the error
    assert "memory plan (dit_weights=replicate" in caplog.text  # and in the log
    assert model.wrappers == {} and all(torch.equal(before[n], t) for n, t in dit.state_dict().items())
    assert roles_apply._COORDINATORS == {}  # no rank thread was started


def test_bad_values_are_clear_errors():
    model, clip, video, audio = inputs()
    with pytest.raises(ValueError, match="dit_weights='halves' is unknown"):
        plan_memory(plan_roles(4), CPU4, model, clip, video, audio, dit_weights="halves")
    with pytest.raises(ValueError, match="dit_weights is shard.*npu_count 2 runs the DiT on one card"):
        plan_memory(plan_roles(2), CPU4[:2], model, clip, video, audio, dit_weights="shard")
    with pytest.raises(ValueError, match="plan_tokens=0"):  # the node's 0 means auto: never planned as 0
        plan_memory(plan_roles(4), CPU4, model, clip, video, audio, tokens=0)


def test_the_table_is_logged(fake_patcher_extension, caplog):  # noqa: F811
    model, clip, video, audio = inputs()
    caplog.set_level(logging.INFO)
    configure_parallel(model, clip, video, audio, npu_count=4, device_kind="cpu", plan_tokens=TOKENS)
    text = caplog.text
    assert "memory plan (dit_weights=replicate, 1000 tokens from plan_tokens)" in text
    assert text.count("cpu: ") >= 4 and "DiT" in text and "text encoder" in text and "VAE decode" in text


@pytest.mark.parametrize("as_patcher", [True, False], ids=["model_patcher", "dit_module"])
def test_shard_through_the_node_is_bit_identical_to_replicate(as_patcher, fake_patcher_extension):  # noqa: F811
    dit = tiny_model(seed=6)
    outs = {}
    for mode in ("replicate", "shard"):
        model = FakeModelPatcher(dit) if as_patcher else dit
        _, clip, video, audio = inputs()
        p_model, *_ = configure_parallel(model, clip, video, audio, npu_count=4, device_kind="cpu",
                                         dit_weights=mode, plan_tokens=TOKENS)
        with torch.inference_mode():
            outs[mode] = [run_dit(p_model, *make_inputs(case, seed=1)[:3], make_inputs(case, seed=1)[3])
                          for case in ("plain", "masked")]
        if mode == "shard" and as_patcher:
            shards = p_model.multinpu_dit_shards
            assert p_model.model.diffusion_model is shards.module(0) is not dit
            assert all(shards.resident_bytes(r) < nbytes(dit) for r in range(4))
            shards.family.close()
        elif mode == "shard":
            p_model.close()
    assert all(torch.equal(a, b) for ra, rb in zip(outs["replicate"], outs["shard"]) for a, b in zip(ra, rb))
    assert all(t.numel() > 0 for t in dit.state_dict().values())  # the input DiT keeps its weights


def test_the_prefetch_lane_is_one_shared_coordinator_across_node_runs(fake_patcher_extension):  # noqa: F811
    model, clip, video, audio = inputs()
    lanes = []
    for _ in range(2):
        p_model, *_ = configure_parallel(model, clip, video, audio, npu_count=4, device_kind="cpu",
                                         dit_weights="shard", plan_tokens=TOKENS)
        family = p_model.multinpu_dit_shards.family
        lanes.append(family.lane)
        family.close()  # the family's own executor; the shared lane keeps running
        assert not family.lane.closed
    assert lanes[0] is lanes[1]
    assert sorted(key[2] for key in roles_apply._COORDINATORS) == ["block weights", "roles"]


def test_cpu_cards_are_checked_together_against_the_hosts_memory(fake_patcher_extension):  # noqa: F811
    model, clip, video, audio = inputs()
    dit = model.model.diffusion_model
    act = activation_bytes(dit_shape_of(dit), TOKENS, 4)
    host = 64 * 2 ** 20
    memory = plan_memory(plan_roles(4), CPU4, model, clip, video, audio, dit_weights="replicate", tokens=TOKENS,
                         free={"host": host})
    # the weights once (the ranks share the base), the activations per rank, the attention's budget
    assert memory.host.items == {"weights": nbytes(dit), "activations": 4 * act, "attention scores": host // 4}
    assert not memory.host_problem() and "the 4 CPU cards share this machine's memory" in memory.table()
    before = {n: t.clone() for n, t in dit.state_dict().items()}
    too_small = nbytes(dit) + 4 * act  # the attention's quarter does not fit beside them
    with pytest.raises(MemoryPlanError) as err:
        configure_parallel(model, clip, video, audio, npu_count=4, device_kind="cpu", dit_weights="replicate",
                           plan_tokens=TOKENS, free_memory={"host": too_small})
    text = str(err.value)
    assert "the 4 CPU cards share this machine's memory" in text and "is available" in text
    assert f"plan_tokens (now {TOKENS})" in text and "npu_count" in text and "\n" not in text
    assert model.wrappers == {} and all(torch.equal(before[n], t) for n, t in dit.state_dict().items())
    assert roles_apply._COORDINATORS == {}  # refused before any rank started
    one = plan_memory(plan_roles(1), CPU4[:1], model, clip, video, audio, tokens=TOKENS)
    assert one.host is None  # one rank: upstream's own sizing, nothing shared


# ----------------------------------------------------------------------------- communicators, quantized copies

NPU4 = ["npu:0", "npu:1", "npu:2", "npu:3"]  # names only: the plan makes no device of them
CUDA4 = ["cuda:0", "cuda:1", "cuda:2", "cuda:3"]
MIB = 2 ** 20


def roomy(devices):
    return {d: 2 ** 40 for d in devices}


@pytest.fixture
def library_defaults(monkeypatch):
    for name in ("HCCL_BUFFSIZE", "NCCL_BUFFSIZE", "NCCL_MAX_NCHANNELS", "COMFYUI_MULTI_DEVICE_BACKEND"):
        monkeypatch.delenv(name, raising=False)


def grown(devices, backend, **kw):
    """Per card and stage, how many bytes `backend`'s plan holds more than peer copies'."""
    model, clip, video, audio = inputs()
    plans = [plan_memory(plan_roles(4), devices, model, clip, video, audio, tokens=TOKENS, free=roomy(devices),
                         backend=b, **kw) for b in ("peer", backend)]
    return [{s: card.stage_total(s) - base.stage_total(s) for s in card.stages}
            for base, card in zip(plans[0].cards, plans[1].cards)], plans[1]


@pytest.mark.parametrize("buffsize_mb,expected", [(None, 400 * MIB), ("100", 200 * MIB)])
def test_an_hccl_communicator_takes_twice_hccl_buffsize_on_every_card_in_every_stage(
        library_defaults, monkeypatch, buffsize_mb, expected):
    if buffsize_mb is not None:
        monkeypatch.setenv("HCCL_BUFFSIZE", buffsize_mb)
    growth, memory = grown(NPU4, "hccl", dit_weights="replicate")
    # one communicator per card (the cards' coordinator), whatever stage runs
    assert growth == [{s: expected for s in card.stages} for card in memory.cards]
    assert all(card.stages["DiT"]["HCCL communicators"] == expected for card in memory.cards)
    assert f"HCCL communicators {expected / 2 ** 30:.2f}" in memory.table()
    # auto on NPUs is HCCL too
    assert grown(NPU4, "auto", dit_weights="replicate")[0] == growth


def test_nccl_buffers_per_peer_and_channel(library_defaults, monkeypatch):
    growth, memory = grown(CUDA4, "nccl", dit_weights="replicate")
    assert all(g == 2 * 4 * MIB * 32 * 3 for card in growth for g in card.values())  # 768 MiB at W = 4
    monkeypatch.setenv("NCCL_BUFFSIZE", str(MIB))
    monkeypatch.setenv("NCCL_MAX_NCHANNELS", "8")
    growth, memory = grown(CUDA4, "nccl", dit_weights="replicate")
    assert memory.cards[0].stages["DiT"]["NCCL communicators"] == 2 * MIB * 8 * 3


def test_ranks_as_processes_add_the_process_groups_and_no_gather_lane_on_cards(library_defaults):
    model, clip, video, audio = inputs()

    def held(backend, dit_weights):
        memory = plan_memory(plan_roles(4), NPU4, model, clip, video, audio, tokens=TOKENS, free=roomy(NPU4),
                             backend=backend, dit_weights=dit_weights, dit_ranks="processes")
        return [c.stages["DiT"]["HCCL communicators"] for c in memory.cards]
    # the cards' coordinator's and the process group's; shard's block gathers use that group on a
    # card (workers/worker.py block_gather_lane makes no second one beside HCCL)
    assert held("hccl", "shard") == [2 * 400 * MIB] * 4
    assert held("hccl", "replicate") == [2 * 400 * MIB] * 4
    # peer copies between the cards leave the process groups (HCCL on NPUs whatever the backend)
    assert held("peer", "replicate") == [400 * MIB] * 4


def test_cpu_cards_and_one_card_hold_no_communicator(library_defaults):
    model, clip, video, audio = inputs()
    memory = plan_memory(plan_roles(4), CPU4, model, clip, video, audio, tokens=TOKENS, backend="hccl")
    assert not any("communicators" in item for c in memory.cards for s in c.stages.values() for item in s)
    one = plan_memory(plan_roles(1), NPU4[:1], model, clip, video, audio, tokens=TOKENS, free=roomy(NPU4),
                      backend="hccl")
    assert not any("communicators" in item for s in one.cards[0].stages.values() for item in s)


def quantize(dit, plain_twin=False, name="adaln_proj.linear.weight"):
    """Make one weight of every block a TwoTensor, a tensor subclass of inner tensors as
    upstream's QuantizedTensor is (`plain_twin`: a plain tensor of the same bytes instead).
    Returns one block's bytes of that weight."""
    from torch.testing._internal.two_tensor import TwoTensor
    for block in dit.blocks:
        owner, leaf = block.get_submodule(name.rsplit(".", 1)[0]), name.rsplit(".", 1)[1]
        w = getattr(owner, leaf).detach()
        value = torch.cat([w, w]) if plain_twin else TwoTensor(w.clone(), w.clone())
        setattr(owner, leaf, torch.nn.Parameter(value, requires_grad=False))
    return 2 * w.numel() * w.element_size()


def test_shard_counts_the_quantized_tensors_of_the_gathered_blocks_twice():
    plans = {}
    for quantized in (False, True):
        model, clip, video, audio = inputs()
        weight_bytes = quantize(model.model.diffusion_model, plain_twin=not quantized)
        plans[quantized] = plan_memory(plan_roles(4), CPU4, model, clip, video, audio, dit_weights="shard",
                                       tokens=TOKENS)
    # the same bytes either way, so the same shards; the 3 blocks' quantized weights are owned by
    # ranks 0, 1 and 2, so every rank gathers one, and holds it twice for each block in flight
    for plain, card in zip(plans[False].cards, plans[True].cards):
        assert plain.stages["DiT"]["quantized copies"] == 0
        assert card.stages["DiT"]["quantized copies"] == IN_FLIGHT_BLOCKS * weight_bytes
        assert card.stage_total("DiT") - plain.stage_total("DiT") == IN_FLIGHT_BLOCKS * weight_bytes
    assert "quantized copies" in plans[True].table()


def test_a_gathered_quantized_tensor_is_a_copy_beside_the_gathered_bytes():
    """What the figure above counts: the rebuilt quantized tensor does not live in the gathered
    flat buffer, which the block keeps while it is bound (plain tensors are views of it)."""
    import copy
    from comfy.multidevice.weights.block_shards import ShardedBlockWeights
    model, *_ = inputs()
    dit = model.model.diffusion_model
    quantize(dit)
    models = [copy.deepcopy(dit) for _ in range(2)]
    family = ShardedBlockWeights(models, lambda m: m.blocks, [torch.device("cpu")] * 2)
    with SequenceParallelCoordinator(["cpu"] * 2, backend="peer") as coord:
        gathered = coord.run(lambda rank, comm: family.gather(rank, comm, 0))
    for rank, (tensors, flat) in enumerate(gathered):
        start, end = flat.untyped_storage().data_ptr(), flat.untyped_storage().data_ptr() + flat.untyped_storage().nbytes()
        for name, value in tensors.items():
            inside = [start <= leaf.untyped_storage().data_ptr() < end
                      for leaf in ([value.a, value.b] if hasattr(value, "a") else [value])]
            assert all(inside) != (name == "adaln_proj.linear.weight"), (rank, name)


def test_an_uneven_split_counts_the_largest_share_and_auto_caps_each_card_by_its_free_memory():
    from comfy.multidevice.sp.cost_model import row_bytes
    from comfy.multidevice.sp.plan import shard_sizes
    model, clip, video, audio = inputs()
    shape = dit_shape_of(model.model.diffusion_model)
    even = plan_memory(plan_roles(4), CPU4, model, clip, video, audio, dit_weights="replicate", tokens=TOKENS)
    uneven = plan_memory(plan_roles(4), CPU4, model, clip, video, audio, dit_weights="replicate", tokens=TOKENS,
                         split_weights=(3, 1, 1, 1))
    largest = max(shard_sizes(TOKENS, 4, (3, 1, 1, 1)))
    assert (uneven.cards[0].stages["DiT"]["activations"] - even.cards[0].stages["DiT"]["activations"]
            == (largest - TOKENS // 4) * row_bytes(shape))
    assert uneven.for_tokens(TOKENS).split_weights == (3, 1, 1, 1)
    assert even.split_caps() == (1.0,) * 4  # CPU: no free-memory figure, no cap
    # a card with room for 100 rows more than the even share's 250 may take 350 of the 1000
    stage = even.cards[0].stage_total("DiT")
    roomy = plan_memory(plan_roles(4), CPU4, model, clip, video, audio, dit_weights="replicate", tokens=TOKENS,
                        free={"cpu": stage + 100 * row_bytes(shape)})
    assert roomy.split_caps() == pytest.approx((0.35,) * 4)


def test_a_compressed_exchange_is_counted_on_every_dit_card_and_kept_per_prompt():
    from comfy.multidevice.sp.cost_model import activation_bytes
    model, clip, video, audio = inputs()
    shape = dit_shape_of(model.model.diffusion_model)
    exact = plan_memory(plan_roles(4), CPU4, model, clip, video, audio, dit_weights="replicate", tokens=TOKENS)
    int8 = plan_memory(plan_roles(4), CPU4, model, clip, video, audio, dit_weights="replicate", tokens=TOKENS,
                       exchange_precision="int8")
    more = activation_bytes(shape, TOKENS, 4, precision="int8") - activation_bytes(shape, TOKENS, 4)
    assert more > 0
    for a, b in zip(exact.cards, int8.cards):
        assert b.stages["DiT"]["activations"] - a.stages["DiT"]["activations"] == more
    assert int8.for_tokens(2 * TOKENS).activations(2 * TOKENS) == activation_bytes(shape, 2 * TOKENS, 4,
                                                                                     precision="int8")
