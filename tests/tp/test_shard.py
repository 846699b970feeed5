"""The tensor-parallel decoder (comfy/multidevice/tp/shard.py) against the single-device result:
exactness in fp32 and bf16 (tolerances: tests/tp/tp_cases.py), what cannot be split, each rank's
memory, and one rank per process over torch.distributed (the fan-out's own tests: test_decoder.py).
"""

from types import SimpleNamespace

import pytest
import torch
import torch.nn as nn

from comfy.multidevice.tensor_bytes import storage_bytes
from comfy.multidevice.tp.layers import TensorParallelError
from comfy.multidevice.tp.decoder import build_tensor_parallel_decoder
from comfy.multidevice.tp.shard import planned_shard_bytes, prefixed_weights, shard_decoder
from tests.qwen_decoder import MiniatureDecoderConfig, build_miniature_decoder
from tests.rank_processes import run_rank_processes
from tests.tp.tp_cases import (BF16_REL_TOL, FP32_REL_TOL, LAYOUTS, coordinator, embedding_elements,
                               expected_rank_bytes, holds_embedding, inputs, rel_err, replicated_elements)


# ----------------------------------------------------------------------------- exactness

@pytest.mark.parametrize("world", [1, 2, 4])
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_hidden_states_match_single_device_fp32(backend, world, layout):
    cfg = LAYOUTS[layout]
    model = build_miniature_decoder(cfg, seed=3)
    embeds, mask = inputs(cfg)
    want, want_mid = model(embeds=embeds.clone(), attention_mask=mask, intermediate_output=0)
    with coordinator(world, backend) as coord:
        assert coord.backend_name == backend
        tp = build_tensor_parallel_decoder(model, coord)
        got, got_mid = tp(embeds=embeds, attention_mask=mask, intermediate_output=0)
    assert got.shape == want.shape and got.dtype == torch.float32
    assert rel_err(got, want) <= FP32_REL_TOL
    assert rel_err(got_mid, want_mid) <= FP32_REL_TOL


@pytest.mark.parametrize("world", [2, 4])
def test_hidden_states_match_single_device_bf16(world):
    cfg = LAYOUTS["separate"]
    model32 = build_miniature_decoder(cfg, seed=4)
    model16 = build_miniature_decoder(cfg, seed=4, dtype=torch.bfloat16)
    embeds, mask = inputs(cfg)
    exact, _ = model32(embeds=embeds.clone(), attention_mask=mask)
    single, _ = model16(embeds=embeds.to(torch.bfloat16), attention_mask=mask)
    with coordinator(world) as coord:
        got, _ = build_tensor_parallel_decoder(model16, coord)(
            embeds=embeds.to(torch.bfloat16), attention_mask=mask)
    assert got.dtype == torch.bfloat16
    assert rel_err(got, single) <= BF16_REL_TOL
    # Same accuracy class as the single-device bf16 run, measured against fp32.
    assert rel_err(got, exact) <= 2 * rel_err(single, exact) + 2.0 ** -8


@pytest.mark.parametrize("world", [2, 4])
def test_input_ids_path_copies_the_embedding_on_first_use(world):
    # Token ids: each shard copies the embedding on its first call, then runs exactly as with the
    # embeddings passed in (bit-identical: a lookup adds no rounding); `embeds` never copies it.
    cfg = LAYOUTS["separate"]
    model = build_miniature_decoder(cfg, seed=5)
    ids = torch.randint(0, cfg.vocab_size, (1, 9), generator=torch.Generator().manual_seed(0))
    want, _ = model(input_ids=ids)
    with coordinator(world) as coord:
        tp = build_tensor_parallel_decoder(model, coord)
        from_embeds, _ = tp(embeds=model.embed_tokens(ids).detach())
        assert not any(holds_embedding(s) for s in tp.shards)
        assert tp.shard_bytes == [expected_rank_bytes(cfg, world, 4)] * world
        got, _ = tp(input_ids=ids)
        assert all(holds_embedding(s) for s in tp.shards)
        assert tp.shard_bytes == [expected_rank_bytes(cfg, world, 4, embedding=True)] * world
        again, _ = tp(input_ids=ids)
    assert rel_err(got, want) <= FP32_REL_TOL
    assert torch.equal(got, from_embeds) and torch.equal(again, got)


# ----------------------------------------------------------------------------- what cannot be split

def test_unsplittable_model_fails_before_any_rank_work():
    cfg = MiniatureDecoderConfig(num_attention_heads=6, num_key_value_heads=2)  # 6 % 4 != 0
    model = build_miniature_decoder(cfg)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with coordinator(4) as coord:
        calls = []
        coord.run = lambda *a, **k: calls.append(a)  # must never be reached
        with pytest.raises(TensorParallelError, match=r"6 query heads over W=4"):
            build_tensor_parallel_decoder(model, coord)
        assert calls == []
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


def test_unsplittable_mlp_width_error():
    model = build_miniature_decoder(MiniatureDecoderConfig(intermediate_size=130))
    with coordinator(4) as coord, pytest.raises(TensorParallelError, match=r"width 130 over W=4"):
        build_tensor_parallel_decoder(model, coord)


# ----------------------------------------------------------------------------- memory

@pytest.mark.parametrize("world", [1, 2, 4])
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_rank_weight_bytes_follow_the_formula(world, layout):
    cfg = LAYOUTS[layout]
    model = build_miniature_decoder(cfg, dtype=torch.bfloat16)
    assert storage_bytes(model) == expected_rank_bytes(cfg, 1, 2, embedding=True)
    planned = planned_shard_bytes(model, world)  # before any shard exists
    with coordinator(world) as coord:
        tp = build_tensor_parallel_decoder(model, coord)
        per_rank = [storage_bytes(s) for s in tp.shards]
        assert not any(holds_embedding(s) for s in tp.shards)
    assert per_rank == [expected_rank_bytes(cfg, world, 2)] * world == planned
    # Without KV replication (W <= KV heads) a rank holds exactly 1/W of the split weights;
    # beyond that (W=4 over 2 KV heads) the formula above adds each rank's whole KV head.
    replicated = replicated_elements(cfg) * 2
    if world <= cfg.num_key_value_heads:
        assert (per_rank[0] - replicated) * world == storage_bytes(model) - replicated - embedding_elements(cfg) * 2


def test_the_split_logs_each_card_and_shows_it_on_the_running_node(monkeypatch, caplog):
    # the running node's text, recorded (ComfyUI's page shows it under the node, not on its bar)
    from comfy.multidevice import progress
    shown = []
    monkeypatch.setattr(progress, "executing_node_text", lambda: shown.append)
    model = build_miniature_decoder(LAYOUTS["separate"])
    with coordinator(4) as coord, caplog.at_level("INFO", logger="comfy.multidevice.tp"):
        build_tensor_parallel_decoder(model, coord)
        devices = [str(d) for d in coord.devices]
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("text encoder shard")]
    assert len(lines) == 4 and all(" GiB " in m and m.endswith(" s") for m in lines), lines
    assert sorted(m.split(" for ")[1].split(":")[0] for m in lines) == sorted(devices)
    assert sorted(shown) == [f"text encoder shard (1/4 of each layer): {k}/4 cards ready" for k in (1, 2, 3, 4)]


class ReadOnlyBase(torch.Tensor):
    """Stand-in for the shared checkpoint's read-only views: writes raise, and the test
    records every byte copied out of it and any whole-tensor materialization."""

    copied_bytes = 0
    whole_copies = []

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", str(func))
        if args and isinstance(args[0], ReadOnlyBase) and name.endswith("_") and not name.startswith("__"):
            raise RuntimeError(f"write to read-only checkpoint tensor ({name})")
        if name in ("to", "clone", "contiguous", "cpu", "float", "bfloat16"):
            cls.whole_copies.append(name)
        if name == "copy_" and isinstance(args[1], ReadOnlyBase):
            cls.copied_bytes += args[1].numel() * args[1].element_size()
        return super().__torch_function__(func, types, args, kwargs)


def test_slicing_a_read_only_base_copies_only_each_ranks_share():
    cfg = LAYOUTS["fused"]
    model = build_miniature_decoder(cfg, seed=8)
    # One flat buffer holding every tensor, like a checkpoint base; keys carry a prefix.
    state = model.state_dict()
    flat = torch.cat([t.reshape(-1) for t in state.values()])
    snapshot = flat.clone()
    base, offset = {}, 0
    for key, t in state.items():
        view = flat.narrow(0, offset, t.numel()).view(t.shape)
        base["model." + key] = view.as_subclass(ReadOnlyBase)
        offset += t.numel()
    with pytest.raises(RuntimeError, match="read-only"):
        base["model.layers.0.mlp.down_proj.weight"].mul_(2)
    world = 4
    for rank in range(world):
        ReadOnlyBase.copied_bytes, ReadOnlyBase.whole_copies = 0, []
        comm = SimpleNamespace(rank=rank, world_size=world, device=torch.device("cpu"))
        shard = shard_decoder(model, comm, weights=prefixed_weights(base, "model."))
        assert ReadOnlyBase.whole_copies == []
        assert ReadOnlyBase.copied_bytes == expected_rank_bytes(cfg, world, 4)
        assert storage_bytes(shard) == expected_rank_bytes(cfg, world, 4)  # no view pins the base
        assert all(type(p) is nn.Parameter for p in shard.parameters())
    assert torch.equal(flat, snapshot)


def test_shards_from_a_real_shared_checkpoint_file(tmp_path, backend):
    # The source: a text-encoder file opened once as the shared read-only base.
    # W=4 over 2 KV heads (replication); the module being split holds other values, so
    # a match proves every weight came from the file.
    from safetensors.torch import save_file

    from comfy.multidevice.weights.checkpoint import SharedCheckpoint, total_bytes_read
    from comfy.multidevice.weights.read_only import is_read_only

    cfg = LAYOUTS["fused"]
    model = build_miniature_decoder(cfg, seed=14)
    path = tmp_path / "text_encoder.safetensors"
    save_file({"model." + k: v.contiguous() for k, v in model.state_dict().items()}, str(path))
    embeds, mask = inputs(cfg)
    want, _ = model(embeds=embeds.clone(), attention_mask=mask)
    before = total_bytes_read()
    base = SharedCheckpoint.open(path)
    written = {k: base[k].clone() for k in base}
    with coordinator(4, backend) as coord:
        tp = build_tensor_parallel_decoder(build_miniature_decoder(cfg, seed=99), coord,
                                           weights=prefixed_weights(base, "model."))
        got, _ = tp(embeds=embeds, attention_mask=mask)
        per_rank = [storage_bytes(s) for s in tp.shards]
        shard_params = [p for s in tp.shards for p in s.parameters()]
    assert total_bytes_read() - before == path.stat().st_size  # read once, for all ranks
    assert rel_err(got, want) <= FP32_REL_TOL
    assert per_rank == [expected_rank_bytes(cfg, 4, 4)] * 4       # slices only, no full copy
    assert not any(is_read_only(p) for p in shard_params)        # each rank owns its slices
    assert all(torch.equal(base[k], t) for k, t in written.items())


def test_weights_from_a_state_dict_match_module_weights():
    cfg = LAYOUTS["separate"]
    model = build_miniature_decoder(cfg, seed=9)
    blank = build_miniature_decoder(cfg, seed=99)  # same layout, other values
    embeds, _ = inputs(cfg)
    want, _ = model(embeds=embeds.clone())
    ids = torch.randint(0, cfg.vocab_size, (1, 9), generator=torch.Generator().manual_seed(1))
    want_ids, _ = model(input_ids=ids)
    with coordinator(2) as coord:
        tp = build_tensor_parallel_decoder(blank, coord, weights=model.state_dict())
        got, _ = tp(embeds=embeds)
        got_ids, _ = tp(input_ids=ids)  # the embedding copied on first use comes from the weights too
    assert rel_err(got, want) <= FP32_REL_TOL
    assert rel_err(got_ids, want_ids) <= FP32_REL_TOL


def test_missing_or_misshaped_weight_is_named():
    cfg = LAYOUTS["separate"]
    model = build_miniature_decoder(cfg)
    sd = model.state_dict()
    del sd["layers.1.self_attn.k_proj.weight"]
    with coordinator(2) as coord:
        with pytest.raises(TensorParallelError, match=r"layers\.1\.self_attn\.k_proj\.weight"):
            build_tensor_parallel_decoder(model, coord, weights=sd)
        sd = model.state_dict()
        sd["layers.0.mlp.up_proj.weight"] = torch.zeros(3, 3)
        with pytest.raises(TensorParallelError, match=r"up_proj\.weight.*\[3, 3\]"):
            build_tensor_parallel_decoder(model, coord, weights=sd)


def _storages(module):
    return {t.untyped_storage().data_ptr() for t in (*module.parameters(), *module.buffers())}


@pytest.mark.parametrize("world", [1, 2, 4])
def test_rank_0_shard_is_memory_of_its_own_beyond_what_the_module_tree_holds(world):
    """Rank 0's shard, on the very device of the decoder it was cut from, shares no storage with
    it, and the fan-out module's own tensors (what a model manager moving and counting the CLIP
    sees: the kept input embedding) include none of any shard's: so a model manager counting
    the CLIP does not count rank 0's shard (roles/model_management.py registers it)."""
    model = build_miniature_decoder(LAYOUTS["separate"], seed=4)
    with coordinator(world) as coord:
        tp = build_tensor_parallel_decoder(model, coord)
        assert not any(holds_embedding(s) for s in tp.shards)
        assert not _storages(tp.shards[0]) & _storages(model)
        assert _storages(tp) == _storages(model.embed_tokens)
        assert all(not _storages(s) & _storages(tp) for s in tp.shards)
        assert tp.shard_bytes[0] == storage_bytes(tp.shards[0]) > 0


def test_decoder_is_not_modified():
    cfg = LAYOUTS["separate"]
    model = build_miniature_decoder(cfg, seed=10)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with coordinator(4) as coord:
        build_tensor_parallel_decoder(model, coord)
    attn = model.layers[0].self_attn
    assert (attn.num_heads, attn.num_kv_heads, attn.inner_size) == (8, 2, 8 * cfg.head_dim)
    assert isinstance(attn.q_proj, nn.Linear) and model.config.num_attention_heads == 8
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


# ----------------------------------------------------------------------------- torch.distributed

def distributed_worker(comm):
    """One process = one rank over comfy/multidevice/comm/torch_dist.py's communicator (gloo on CPU)."""
    cfg = LAYOUTS["fused"]
    model = build_miniature_decoder(cfg, seed=13)  # same seed: same model in every process
    embeds, mask = inputs(cfg)
    want, _ = model(embeds=embeds.clone(), attention_mask=mask)
    shard = shard_decoder(model, comm)
    got, _ = shard(embeds=embeds.clone(), attention_mask=mask)
    return rel_err(got, want), storage_bytes(shard)


@pytest.mark.timeout(120)
def test_shards_run_over_the_torch_distributed_communicator(tmp_path):
    world = 2
    out = run_rank_processes(world, "tests.tp.test_shard", "distributed_worker", tmp_path)
    assert sorted(out) == list(range(world)), f"ranks reported: {sorted(out)}"
    for rank, (status, payload) in sorted(out.items()):
        assert status == "ok", f"rank {rank}: {payload}"
        err, nbytes = payload
        assert err <= FP32_REL_TOL
        assert nbytes == expected_rank_bytes(LAYOUTS["fused"], world, 4)
