"""What sequence parallel costs: exact bytes per rank, and the activation memory it holds.

Pure arithmetic (no torch), read by the `auto` mode choice (comfy/multidevice/sp/mode_choice.py),
the dry run and the memory plan; the tests check these formulas against the byte counters of a
real run. The H3 projections add FLOPs and weight bytes to them in bench/h3_costs.py.

The shard plan is the SP core's: rank r owns rows [S*r//W, S*(r+1)//W). Bytes are the
coordinator's logical bytes (comfy/multidevice/comm/group.py): payload to / from *other* ranks.

Modes, for one attention call over heads H of width D (q, k, v, out all H*D wide):

- allgather: every rank gathers K and V from all ranks (two all-gather-V), keeps its Q.
- ulysses with degree U (U | W; U = W is plain Ulysses, U < W the hybrid): the ranks form
  W/U sequence groups of U consecutive ranks; member u of a group owns head block u
  ([H*u//U, H*(u+1)//U)). Q moves inside the group (all-to-all), K and V move from every
  rank to every rank that owns the head block (all-to-all over all ranks; with U < W the same
  head block goes to W/U ranks, i.e. "all-gather across groups"), the output goes back inside
  the group. U = 1 moves exactly the allgather bytes.
"""

from __future__ import annotations

from dataclasses import dataclass

from comfy.multidevice.comm.compression import EXACT, record_width
from comfy.multidevice.sp.plan import shard_sizes


def ulysses_degree(world: int, heads: int) -> int:
    """The hybrid rule: Ulysses over the largest group size that divides both W and the heads
    (W itself when the heads divide evenly), all-gather of K/V across the W/U groups."""
    if world < 1 or heads < 1:
        raise ValueError(f"need world >= 1 and heads >= 1, got world={world}, heads={heads}")
    return max(d for d in range(1, world + 1) if world % d == 0 and heads % d == 0)


@dataclass(frozen=True)
class Traffic:
    sent: int
    received: int

    def __add__(self, other: "Traffic") -> "Traffic":
        return Traffic(self.sent + other.sent, self.received + other.received)

    def scaled(self, factor: int) -> "Traffic":
        return Traffic(self.sent * factor, self.received * factor)


def attention_traffic(mode: str, seq_len: int, world: int, rank: int, heads: int, head_dim: int,
                      itemsize: int, degree: int | None = None, weights=None) -> Traffic:
    """Bytes rank `rank` sends / receives for ONE attention call (one block) in `mode`.

    mode "ulysses" uses `degree` (default: `ulysses_degree(world, heads)`); "allgather" is
    the K/V all-gather. Exact for uneven shards (S not divisible by W, or per-rank `weights`).
    """
    rows = shard_sizes(seq_len, world, weights)
    width = head_dim * itemsize  # bytes of one row of one head
    if world == 1:
        return Traffic(0, 0)
    if mode == "allgather":
        own = rows[rank]
        return Traffic(sent=2 * own * heads * width * (world - 1),
                       received=2 * (seq_len - own) * heads * width)
    if mode != "ulysses":
        raise ValueError(f"unknown sequence-parallel mode {mode!r}; valid: allgather, ulysses")
    u_deg = degree or ulysses_degree(world, heads)
    if world % u_deg:
        raise ValueError(f"ulysses degree {u_deg} does not divide the world size {world}")
    groups = world // u_deg
    head_blocks = shard_sizes(heads, u_deg)
    group, member = divmod(rank, u_deg)
    members = range(group * u_deg, (group + 1) * u_deg)
    group_rows = sum(rows[m] for m in members)
    own, my_heads = rows[rank], head_blocks[member]
    # q: to the other members, my rows of their heads; from them, their rows of my heads
    q = Traffic(own * (heads - my_heads), (group_rows - own) * my_heads)
    # k, v: my rows of head block b to every rank owning b (groups of them), minus myself
    kv = Traffic(own * (groups * heads - my_heads), (seq_len - own) * my_heads).scaled(2)
    # out: the reverse of q
    out = Traffic(q.received, q.sent)
    total = q + kv + out
    return Traffic(total.sent * width, total.received * width)


@dataclass(frozen=True)
class DiTShape:
    """The sizes the cost model needs (defaults: the released MiniMax-H3 DiT)."""

    hidden: int = 5376
    blocks: int = 50
    heads: int = 56
    head_dim: int = 128
    ffn: int = 14336  # SwiGLU: fc1 hidden -> 2*ffn, fc2 ffn -> hidden

    @property
    def attention_width(self) -> int:
        return self.heads * self.head_dim


def hidden_gather_traffic(shape: DiTShape, seq_len: int, world: int, rank: int,
                          itemsize: int = 2, weights=None) -> Traffic:
    """Bytes of the all-gather of the hidden state after the last block (every rank gets the
    full sequence for the final layer)."""
    own = shard_sizes(seq_len, world, weights)[rank]
    row = shape.hidden * itemsize
    return Traffic(own * row * (world - 1), (seq_len - own) * row)


def forward_traffic(mode: str, shape: DiTShape, seq_len: int, world: int, rank: int,
                    itemsize: int = 2, degree: int | None = None, weights=None) -> dict:
    """Bytes of one DiT forward for one rank: attention exchanges of every block, plus the
    all-gather of the hidden state before the final layer."""
    attention = attention_traffic(mode, seq_len, world, rank, shape.heads, shape.head_dim,
                                  itemsize, degree, weights).scaled(shape.blocks)
    final = hidden_gather_traffic(shape, seq_len, world, rank, itemsize, weights)
    return {"attention": attention, "final_gather": final, "total": attention + final}


def activation_bytes(shape: DiTShape, seq_len: int, world: int, itemsize: int = 2,
                     mode: str = "allgather", degree: int | None = None, weights=None,
                     precision: str = EXACT) -> int:
    """An estimate of the DiT's peak activation bytes on one rank under sequence parallel.

    Held for the whole sequence on every rank: the embedded hidden state before block 0 and
    the gathered one after the last block ([S, hidden] each) and the RoPE table (fp32,
    [S, 48, 2, 2] at H3's head dim). What one block's exchange holds (`exchanged_bytes`): the
    all-gather the full K and V; Ulysses its head block of q, k, v and the output.
    Held for the rank's own rows L = ceil(S/W) inside one block: q/k/v before and after the
    norm and rotation (6 H*D), the attention output (H*D), the modulated inputs and residual
    updates (4 hidden) and the SwiGLU's 2F + F. A fused attention kernel is assumed (no
    [L, S] score matrix); with per-rank `weights` (mixed cards) L is the largest share. With a
    compressed exchange (`precision` int8 / fp8) the received byte records are held beside what
    they decode into: (1 + 2/128) bytes per exchanged value more (comm/compression.py). Not
    counted: the text refiner (short), allocator fragmentation, and
    under the peer backend the previous block's own q/k/v rows, which the coordinator holds for
    the peers until the next collective (about 4 H*D per own row; bench/bench_sp_modes.py
    measures the all-gather's peak 1.2x this estimate on CPU ranks, Ulysses' 1.05x: within
    bench/h3_costs.py's ACTIVATION_MARGIN, which its test holds it to).
    """
    rows = -(-seq_len // max(world, 1)) if weights is None else max(shard_sizes(seq_len, world, weights))
    rope = seq_len * (shape.head_dim * 3 // 4) * 2 * 4  # 96 rotated dims -> 48 pairs of 2x2 fp32
    full = seq_len * 2 * shape.hidden * itemsize + rope
    held = exchanged_bytes(shape, seq_len, world, itemsize, mode, degree)
    if precision != EXACT:
        held += held // itemsize * record_width(shape.head_dim) // shape.head_dim
    return full + held + rows * row_bytes(shape, itemsize)


def row_bytes(shape: DiTShape, itemsize: int = 2) -> int:
    """What one of the rank's own rows holds inside one block (activation_bytes' L term)."""
    a = shape.attention_width
    return (6 * a + a + 4 * shape.hidden + 3 * shape.ffn) * itemsize


def exchanged_bytes(shape: DiTShape, seq_len: int, world: int, itemsize: int = 2,
                    mode: str = "allgather", degree: int | None = None) -> int:
    """What one block's attention exchange holds on the rank with the most rows (its buffers,
    kept by the strategy for the whole forward).

    allgather: the gathered K and V, [S, H*D] each. ulysses with degree U: what the rank
    receives, its head block (H/U heads) of q and of the output for its group's rows (U/W of the
    sequence) and of K and V for the whole sequence, 2 (S + S*U/W) H*D/U; and what it sends, K
    and V of its own rows packed per peer (H3's K and V are separate tensors after the norm and
    the rotation; q goes as it lies), 2 (S/W) H*D W/U. Plain Ulysses (U = W): 6 S H*D/W against
    the all-gather's 2 S H*D, i.e. 3/W of it (bench/bench_sp_modes.py measures both).
    """
    a = shape.attention_width
    if world <= 1:
        return 0
    if mode == "allgather":
        return 2 * seq_len * a * itemsize
    if mode != "ulysses":
        raise ValueError(f"unknown sequence-parallel mode {mode!r}; valid: allgather, ulysses")
    u_deg = degree or ulysses_degree(world, shape.heads)
    head_block = -(-shape.heads // u_deg) * shape.head_dim
    group_rows = -(-seq_len * u_deg // world)
    own_rows = -(-seq_len // world)
    received = 2 * (seq_len + group_rows) * head_block
    packed = 2 * own_rows * a * (world // u_deg)
    return (received + packed) * itemsize
