"""H3's costs that only the projections use: FLOPs per forward, parameters and weight bytes.

The package's cost model (comfy/multidevice/sp/cost_model.py) keeps what the node, the dry
run, the memory plan and the `auto` choice read (bytes exchanged, activation and exchange
buffers); bench/project_h3.py and bench/bench_memory.py add these to it.
"""

from __future__ import annotations

from comfy.multidevice.sp.cost_model import DiTShape

VIDEO_PATCH = 96  # input channels of one video row (24 latent channels x patch 2x2)
AUDIO_PATCH = 32  # ... of one audio row
ACTIVATION_MARGIN = 1.25  # a measured peak over cost_model.activation_bytes, at most (bench/bench_sp_modes.py)


def linear_flops_per_token(shape: DiTShape) -> int:
    """Multiply-add FLOPs (2 per MAC) of one block's linear layers for one token: qkv,
    out_proj, SwiGLU fc1 (hidden -> 2 ffn) and fc2."""
    a, h = shape.attention_width, shape.hidden
    return 2 * (h * 3 * a + a * h + h * 2 * shape.ffn + shape.ffn * h)


def forward_flops(shape: DiTShape, seq_len: int) -> dict:
    """Multiply-add FLOPs (2 per MAC) of the blocks of one forward over `seq_len` tokens.

    linear: qkv, out_proj, fc1, fc2 per token per block; attention: QK^T and PV
    (4 * S^2 * H * D per block). Modulation, norms, RoPE, softmax, embeddings, the text
    refiner and the final layer are left out (each under 1% at H3's sizes).
    """
    linear = linear_flops_per_token(shape) * seq_len * shape.blocks
    attention = 4 * seq_len * seq_len * shape.attention_width * shape.blocks
    return {"linear": linear, "attention": attention, "total": linear + attention}


def block_parameters(shape: DiTShape, t_dim: int = 2688, modalities: int = 3) -> int:
    """Parameters of one H3 transformer block: qkv, out_proj, SwiGLU fc1/fc2, the adaLN
    projection (6 chunks x modality rows from the t_dim-wide timestep embedding, with bias),
    two RMS norms over the hidden size and the q/k norms over the head dim."""
    h = shape.hidden
    adaln = (6 * h * modalities) * (t_dim + 1)
    return linear_flops_per_token(shape) // 2 + adaln + 2 * h + 2 * shape.head_dim


def sharded_weight_bytes(block_bytes: int, blocks: int, other_bytes: int, world: int,
                         in_flight: int = 2) -> dict:
    """DiT weight bytes one card holds with dit_weights=shard (blocks balanced over W ranks by
    whole tensors: the exact split is weights/block_shards.py's, this is its mean) and with
    replicate. `in_flight`: gathered blocks alive at once (the running one and the prefetch)."""
    replica = block_bytes * blocks + other_bytes
    if world <= 1:
        return {"replicate": replica, "shard": replica, "shard_resident": replica, "gathered": 0}
    resident = other_bytes + -(-block_bytes * blocks // world)
    gathered = min(in_flight, blocks) * block_bytes
    return {"replicate": replica, "shard": resident + gathered, "shard_resident": resident,
            "gathered": gathered}
