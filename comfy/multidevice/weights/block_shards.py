"""DiT block weights sharded across the ranks (`dit_weights="shard"`), exact.

Each rank keeps only the block tensors it owns; just before block i runs, the ranks gather
block i's tensors, and after the block the gathered copies are dropped again. Everything
outside the blocks (embeddings, text refiner, final layer) stays on every rank.

- Ownership is by whole tensor: a quantized weight keeps its data and scales together and a
  LoRA-patched weight is sent exactly as its owner holds it, so the gathered block is
  bit-identical to a full replica's. Tensors go to the least-loaded rank, largest first, over
  all blocks at once, so the resident bytes are balanced across the ranks.
- The gather is one all-gather-V of a flat byte buffer per block through a `Communicator`
  (peer, HCCL, NCCL or torch.distributed all work): rank r contributes the bytes of the tensors
  it owns in block i, in a fixed order every rank knows, and unpacks the others' from the
  result. Tensor subclasses that follow torch's `__tensor_flatten__` protocol (upstream's
  `QuantizedTensor`) are sent as their inner tensors and rebuilt on the receiver.
- Prefetch: with a `lane` (a second coordinator over the same cards: its rank threads are the
  helper threads) block i+1's gather runs there while block i computes on the rank threads.
  With one rank per process (ranks as processes) the lane is `OwnRankLane`: a second process
  group, driven from a helper thread of the process. Without one, each rank gathers through
  its own communicator just before the block, from its own thread, in the same order on
  every rank.
- Only where a second communicator on a card is safe: peer-copy, and gloo on CPU. HCCL and
  NCCL allow one collective per card at a time across all communicators (CANN: "one card
  cannot invoke multiple collective operation APIs at a time"; NCCL: not safe to drive
  independent communicators of one device from several threads), and the lane's gathers
  would overlap the K/V exchange; so with them there is no lane (comm/group.py
  `lane_allowed`, workers/worker.py `block_gather_lane`).

The owner reads its tensors from the module at gather time, so a weight that ComfyUI patched
or moved after set-up is sent as it is now.
"""

from __future__ import annotations

import functools
import logging
import math
import threading
from collections import Counter
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch

from comfy.multidevice.devices import accelerator_api, set_thread_device
from comfy.multidevice.tensor_bytes import is_flattenable, tensor_leaves, tensor_nbytes

log = logging.getLogger(__name__)

ALIGN = 64  # bytes: every tensor starts aligned in the flat buffer, so `.view(dtype)` is legal
# dit_weights: "replicate" a full DiT per card, "shard" 1/W of the block weights per card; the
# node's "auto" is resolved to one of the two by roles/memory_plan.py before a role applies it.
APPLIED_DIT_WEIGHT_MODES = ("replicate", "shard")
DIT_WEIGHT_MODES = (*APPLIED_DIT_WEIGHT_MODES, "auto")


class BlockShardError(RuntimeError):
    """The sharded block weights cannot serve this forward (the message says why and what to do)."""


def _aligned(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


# ----------------------------------------------------------------------------- tensor layout

@dataclass(frozen=True)
class _LeafSpec:
    shape: tuple
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


class _TensorSpec:
    """How to send one block tensor and rebuild it on a receiver (plain or flattenable)."""

    def __init__(self, name: str, value: torch.Tensor, is_parameter: bool, dtype: torch.dtype | None = None):
        """`dtype`: a plain tensor's dtype on its owner, where `value` is another form of it."""
        self.name = name
        self.is_parameter = is_parameter
        self.leaves = [_LeafSpec(tuple(t.shape), t.dtype) for t in tensor_leaves(value)]
        if dtype is not None and not is_flattenable(value):
            self.leaves = [_LeafSpec(tuple(value.shape), dtype)]
        self.nbytes = sum(leaf.nbytes for leaf in self.leaves)
        # other subclasses (e.g. our read-only base views) arrive as plain tensors, same values
        self._rebuild = self._rebuild_fn(value) if is_flattenable(value) else None

    @staticmethod
    def _rebuild_fn(value) -> Callable[[list[torch.Tensor]], torch.Tensor]:
        names, ctx = value.__tensor_flatten__()
        # per inner tensor: how many leaves it takes and how to rebuild it (None: one plain
        # leaf); the structure only, so the set-up's tensors are not kept alive
        parts = []
        for name in names:
            sub = getattr(value, name)
            parts.append((name, len(tensor_leaves(sub)), _TensorSpec._rebuild_fn(sub) if is_flattenable(sub) else None))
        size, stride, cls = value.size(), value.stride(), type(value)

        def rebuild(leaves: list[torch.Tensor]) -> torch.Tensor:
            inner, at = {}, 0
            for name, n, sub_rebuild in parts:
                inner[name] = leaves[at] if sub_rebuild is None else sub_rebuild(leaves[at:at + n])
                at += n
            return cls.__tensor_unflatten__(inner, ctx, size, stride)
        return rebuild

    def check(self, value: torch.Tensor, where: str) -> list[torch.Tensor]:
        leaves = tensor_leaves(value)
        have = [_LeafSpec(tuple(t.shape), t.dtype) for t in leaves]
        if have != self.leaves:
            raise BlockShardError(
                f"{where}: block weight {self.name!r} changed its layout since the shards were made "
                f"({have} instead of {self.leaves}); run the node again after changing the model")
        return leaves

    def rebuild(self, leaves: list[torch.Tensor]) -> torch.Tensor:
        if self._rebuild is None:
            value = leaves[0]
        else:  # a subclass may check its inner tensors' storage offsets: each gets its own storage
            value = self._rebuild([leaf.clone() for leaf in leaves])
        return torch.nn.Parameter(value, requires_grad=False) if self.is_parameter else value


def _block_slots(block: torch.nn.Module) -> dict[str, tuple[torch.nn.Module, str, bool]]:
    """name -> (owning submodule, attribute, is_parameter) for every parameter and persistent
    buffer of a block: the tensors it really holds (a quantized layer's state dict lists its
    scales under names of their own, but holds them inside its weight)."""
    slots = {}
    for path, module in block.named_modules():
        prefix = f"{path}." if path else ""
        for leaf, value in module._parameters.items():
            if value is not None:
                slots[prefix + leaf] = (module, leaf, True)
        for leaf, value in module._buffers.items():
            if value is not None and leaf not in module._non_persistent_buffers_set:
                slots[prefix + leaf] = (module, leaf, False)
    return slots


def block_tensors(block: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The tensors a block holds, by the names the shards use (see _block_slots)."""
    return {name: _get(slot) for name, slot in _block_slots(block).items()}


def _get(slot) -> torch.Tensor:
    owner, leaf, is_param = slot
    return (owner._parameters if is_param else owner._buffers)[leaf]


def _set(slot, value) -> None:
    owner, leaf, is_param = slot
    (owner._parameters if is_param else owner._buffers)[leaf] = value


# ----------------------------------------------------------------------------- ownership

@dataclass(frozen=True)
class BlockShardPlan:
    """owner[i][name] = the rank that keeps tensor `name` of block i (whole tensors)."""

    world_size: int
    owner: tuple  # per block: {name: rank}
    nbytes: tuple  # per block: {name: bytes}

    @staticmethod
    def balanced(block_bytes: Sequence[dict], world_size: int,
                 together: Sequence[dict] | None = None) -> "BlockShardPlan":
        """Largest unit first to the least-loaded rank (ties: the lower rank), over all blocks.

        A unit is one tensor, or the tensors that `together[i]` maps to one unit name (e.g. a
        quantized layer's weight and bias, which its loader rebuilds, and a patch changes, as one).
        """
        if world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {world_size}")
        unit_of = [{name: (together[i] if together else {}).get(name, name) for name in b}
                   for i, b in enumerate(block_bytes)]
        units = Counter()
        for i, b in enumerate(block_bytes):
            for name, n in b.items():
                units[(i, unit_of[i][name])] += n
        load = [0] * world_size
        unit_owner = {}
        for (i, unit), n in sorted(units.items(), key=lambda x: (-x[1], x[0][0], x[0][1])):
            r = min(range(world_size), key=lambda k: (load[k], k))
            unit_owner[(i, unit)] = r
            load[r] += n
        owner = tuple({name: unit_owner[(i, unit_of[i][name])] for name in b} for i, b in enumerate(block_bytes))
        return BlockShardPlan(world_size, owner, tuple(dict(b) for b in block_bytes))

    def owned_bytes(self, rank: int) -> int:
        return sum(n for own, nb in zip(self.owner, self.nbytes) for name, n in nb.items() if own[name] == rank)

    def block_bytes(self, index: int) -> int:
        return sum(self.nbytes[index].values())

    def names_of(self, index: int, rank: int) -> list[str]:
        """Block `index`'s tensors owned by `rank`, in the order they are packed."""
        return [name for name in self.nbytes[index] if self.owner[index][name] == rank]


# ----------------------------------------------------------------------------- the family

class ShardedBlockWeights:
    """The block weights of W per-rank DiT modules, sharded: one object for all ranks.

    models[r]   rank r's DiT module (on its card); the block tensors rank r does not own are
                dropped from it here (an empty placeholder stays in their slot, so running a
                block without its gather fails loudly). None for a rank of another process
                (one process per rank, torchrun): this process serves its own ranks only.
    devices[r]  rank r's device (None where models[r] is None).
    plan        who owns what; None: balanced over the first local model's tensors (then the
                local models must hold every tensor now). With a plan, a rank need only hold
                the tensors it owns.
    blocks_of   module -> its sequence of transformer blocks (H3 contract: `model.blocks`).
    lane        None, or an object with `run(fn, per_rank_args)` over the same devices
                (a second coordinator): block i+1's gather is then prefetched there; closed
                by `close()` when `own_lane` (a shared one is left running).
    timeout_s   how long a rank waits for a prefetched gather before it raises.
    remote_dtype  for a plain tensor another process owns: (block, name, the local model's
                tensor) -> the dtype its owner holds it in (the local model may hold it as the
                checkpoint stores it); None: the local model's dtype.
    """

    def __init__(self, models: Sequence[torch.nn.Module], blocks_of: Callable[[Any], Sequence],
                 devices: Sequence[torch.device], lane=None, timeout_s: float = 600.0,
                 plan: "BlockShardPlan | None" = None, own_lane: bool = True,
                 remote_dtype: Callable[[int, str, torch.Tensor], torch.dtype] | None = None):
        if len(models) != len(devices):
            raise ValueError(f"ShardedBlockWeights got {len(models)} models for {len(devices)} devices")
        self.models = list(models)
        self.devices = list(devices)
        self.world_size = len(self.models)
        self.timeout_s = timeout_s
        self.local_ranks = [r for r, m in enumerate(self.models) if m is not None]
        if not self.local_ranks:
            raise ValueError("ShardedBlockWeights needs the model of at least one rank of this process")
        if lane is not None and len(self.local_ranks) != self.world_size and not isinstance(lane, OwnRankLane):
            raise ValueError("a prefetch lane needs every rank in this process, or an OwnRankLane for "
                             "the one rank of this process; pass lane=None")
        first = self.local_ranks[0]
        self.num_blocks = len(list(blocks_of(self.models[first])))
        self._slots = [None] * self.world_size  # per local rank, per block: {name: slot}
        for r in self.local_ranks:
            blocks = list(blocks_of(self.models[r]))
            if len(blocks) != self.num_blocks:
                raise ValueError(f"rank {r}'s model has {len(blocks)} blocks, rank {first}'s {self.num_blocks}")
            self._slots[r] = [_block_slots(b) for b in blocks]
            for i, slots in enumerate(self._slots[r]):
                if list(slots) != list(self._slots[first][i]):
                    raise ValueError(f"rank {r}'s block {i} has other tensors than rank {first}'s")
        if plan is None:  # the local models hold every tensor now: their sizes
            plan = BlockShardPlan.balanced(
                [{n: tensor_nbytes(_get(slot)) for n, slot in slots.items()} for slots in self._slots[first]],
                self.world_size)
        elif plan.world_size != self.world_size or len(plan.owner) != self.num_blocks:
            raise ValueError(f"the shard plan is for {plan.world_size} ranks and {len(plan.owner)} "
                             f"blocks, the models are {self.world_size} ranks of {self.num_blocks} blocks")
        self.plan = plan
        # What each tensor looks like, read from its owner (the only rank that must hold it now),
        # or, for an owner in another process, from a local model that still holds it (bound to
        # the base, in the dtype remote_dtype says the owner's card holds).
        def spec(i, name, is_parameter):
            owner = plan.owner[i][name]
            if self._slots[owner] is not None:
                return _TensorSpec(name, _get(self._slots[owner][i][name]), is_parameter)
            value = _get(self._slots[first][i][name])
            dtype = remote_dtype(i, name, value) if remote_dtype is not None else None
            return _TensorSpec(name, value, is_parameter, dtype)
        self.specs = [{name: spec(i, name, slot[2]) for name, slot in slots.items()}
                      for i, slots in enumerate(self._slots[first])]
        for r in self.local_ranks:
            self.drop_unowned(r)
        self.lane = None
        self._own_lane = own_lane  # close() closes the lane only when it was made for this family
        self._lock = threading.Lock()
        self._pending: dict = {}  # (generation, block) -> [Future, ranks that took their part]
        self._generation = [0] * self.world_size
        self._executor = None
        self.use_lane(lane)
        self.gathered_bytes = [0] * self.world_size  # bytes each rank received in gathers, cumulative
        self._streams: dict = {}  # rank -> the side stream of its prefetches (cards only)

    # -- set-up
    def drop_unowned(self, r: int, index: int | None = None) -> None:
        """Empty rank `r`'s slots of the tensors other ranks own, of block `index` (after its
        gather was used) or of every block (again, after its module was bound to a full set of
        weights, e.g. reloaded from the base after an eviction)."""
        for i in range(self.num_blocks) if index is None else (index,):
            for name, slot in self._slots[r][i].items():
                if self.plan.owner[i][name] != r:
                    _set(slot, self._placeholder(i, name, r))

    def _placeholder(self, index: int, name: str, rank: int):
        spec = self.specs[index][name]
        empty = torch.empty(0, dtype=spec.leaves[0].dtype, device=self.devices[rank])
        return torch.nn.Parameter(empty, requires_grad=False) if spec.is_parameter else empty

    def resident_bytes(self, rank: int) -> int:
        """Bytes of block tensors rank `rank` keeps between blocks (what it owns)."""
        return self.plan.owned_bytes(rank)

    def rank_view(self, rank: int) -> "RankBlockWeights":
        return RankBlockWeights(self, rank)

    # -- one gather (runs on a rank thread of the lane, or on the rank's own thread)
    def _pack(self, rank: int, index: int) -> torch.Tensor:
        where, device = f"rank {rank}, block {index}", self.devices[rank]
        parts = []
        for name in self.plan.names_of(index, rank):
            for leaf in self.specs[index][name].check(_get(self._slots[rank][index][name]), where):
                raw = leaf.contiguous().view(-1).view(torch.uint8).to(device)
                pad = _aligned(raw.numel()) - raw.numel()
                parts.append(raw)
                if pad:  # per leaf of every gathered block: no empty tensor made where none is needed
                    parts.append(torch.zeros(pad, dtype=torch.uint8, device=device))
        return torch.cat(parts) if parts else torch.empty(0, dtype=torch.uint8, device=device)

    def gather(self, rank: int, comm, index: int) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        """Block `index`'s tensors this rank does not own, received from their owners (exact),
        and the flat buffer they are views of."""
        flat = comm.exchange([self._pack(rank, index)], 0)[0]
        out, at = {}, 0
        for owner in range(self.world_size):
            for name in self.plan.names_of(index, owner):
                spec = self.specs[index][name]
                leaves = []
                for leaf in spec.leaves:
                    if owner != rank:
                        raw = flat.narrow(0, at, leaf.nbytes)
                        leaves.append(raw.view(leaf.dtype).view(leaf.shape))
                    at += _aligned(leaf.nbytes)
                if owner != rank:
                    out[name] = spec.rebuild(leaves)
        if at != flat.numel():
            raise BlockShardError(f"rank {rank}, block {index}: gathered {flat.numel()} bytes, "
                                  f"the shard plan expects {at}")
        self.gathered_bytes[rank] += sum(self.specs[index][n].nbytes for n in out)
        return out, flat

    def _gather_on_side_stream(self, rank: int, comm, index: int):
        # On a card the prefetch runs on its own stream so it overlaps the block's kernels; the
        # collective synchronizes that stream before it returns (comm/ backends), and the stream
        # is synchronized here once more so the rank thread can use the result at once.
        device = self.devices[rank]
        api = accelerator_api(device.type)
        if api is None:
            return self.gather(rank, comm, index)
        stream = self._streams.get(rank)
        if stream is None:
            stream = self._streams[rank] = api.Stream(device)
        # the owner's tensors may still be being written on the compute stream (a weight patched
        # or moved there): the gather's copies must start after that work
        stream.wait_stream(api.current_stream(device))
        with api.stream(stream):
            result = self.gather(rank, comm, index)
        stream.synchronize()
        return result

    # -- prefetch on the lane
    def use_lane(self, lane, timeout_s: float | None = None) -> None:
        """Prefetch on `lane` from now on (None: gather on the rank's own communicator). Ranks as
        processes give each new pool's OwnRankLane here; gathers still pending on the last lane
        are dropped with it (they belong to that pool's collectives)."""
        with self._lock:
            old, self._executor = self._executor, None
            self._pending.clear()
            self.lane = lane
            if lane is not None:
                self._executor = ThreadPoolExecutor(1, thread_name_prefix="block-gather")
            if timeout_s is not None:
                self.timeout_s = timeout_s
        if old is not None:
            old.shutdown(wait=False, cancel_futures=True)  # a gather stuck in a dead pool stays behind

    def _submit(self, key) -> Future:
        gather = functools.partial(self._gather_on_side_stream, index=key[1])
        return self._executor.submit(self.lane.run, gather)  # this lane's, even if another replaces it

    def request(self, rank: int, index: int) -> None:
        """Make sure block `index`'s gather (of this rank's current forward) is under way."""
        if self.lane is None or not 0 <= index < self.num_blocks:
            return
        key = (self._generation[rank], index)
        with self._lock:
            if key not in self._pending:
                self._pending[key] = [self._submit(key), set()]

    def take(self, rank: int, comm, index: int) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        """Block `index`'s tensors this rank does not own (from the prefetch when there is one)."""
        if self.lane is None:
            return self.gather(rank, comm, index)
        self.request(rank, index)
        key = (self._generation[rank], index)
        with self._lock:
            entry = self._pending[key]
        try:
            results = entry[0].result(timeout=self.timeout_s)
        except TimeoutError as exc:
            raise BlockShardError(f"rank {rank}: block {index}'s weights did not arrive within "
                                  f"{self.timeout_s:.0f} s") from exc
        with self._lock:
            entry[1].add(rank)
            if len(entry[1]) == len(self.local_ranks):
                self._pending.pop(key, None)  # every rank has its part: the family keeps nothing
        return results[rank]

    def begin_forward(self, rank: int) -> None:
        """A new forward on `rank`: its requests count from block 0 again; stale gathers go."""
        self._generation[rank] += 1
        oldest = min(self._generation[r] for r in self.local_ranks)
        with self._lock:
            for key in [k for k in self._pending if k[0] < oldest]:
                self._pending.pop(key)

    def close(self) -> None:
        if self._executor is not None:
            self._executor.shutdown(wait=True)
            self._executor = None
        if self._own_lane and self.lane is not None and callable(getattr(self.lane, "close", None)):
            self.lane.close()


class OwnRankLane:
    """The prefetch lane of the one rank of this process (ranks as processes): `comm` is a
    communicator over a second process group beside the forward's, so a block's gather
    travels on it from the family's helper thread while the rank thread computes. Every rank
    requests the same blocks in the same order, so the gathers on it pair up."""

    def __init__(self, comm):
        self.comm = comm

    def run(self, fn) -> list:
        # the family's helper thread, not the rank's: without its device set, torch_npu would
        # open a context and streams on card 0 for it (CARDS.md), memory no plan counts
        set_thread_device(self.comm.device)
        out = [None] * self.comm.world_size
        out[self.comm.rank] = fn(self.comm.rank, self.comm)
        return out


def _made_on_the_prefetch_stream(flat: torch.Tensor, gathered: dict) -> list[torch.Tensor]:
    """The flat buffer and every leaf of the gathered tensors held in other memory (the
    clones of a flattenable subclass's inner tensors); empty ones left out."""
    storage = flat.untyped_storage().data_ptr() if flat.numel() else None
    out = [flat] if flat.numel() else []
    for value in gathered.values():
        out += [leaf for leaf in tensor_leaves(value)
                if leaf.numel() and leaf.untyped_storage().data_ptr() != storage]
    return out


class RankBlockWeights:
    """One rank's handle: `with weights.block(i, comm):` binds block i's gathered tensors."""

    def __init__(self, family: ShardedBlockWeights, rank: int):
        self.family = family
        self.rank = rank

    @property
    def model(self):
        return self.family.models[self.rank]

    def begin_forward(self) -> None:
        self.family.begin_forward(self.rank)

    def bind(self, index: int, comm) -> None:
        family = self.family
        gathered, flat = family.take(self.rank, comm, index)
        family.request(self.rank, index + 1)  # block i+1 travels while block i computes
        device = family.devices[self.rank]
        api = accelerator_api(device.type)
        if api is not None:
            # made on the prefetch stream, used on this one: the allocator must not hand their
            # memory to the next prefetch before this stream is done with it (release() drops
            # them while block i may still run) - the flat buffer and the clones a tensor
            # subclass's rebuild made of its inner tensors alike
            stream = api.current_stream(device)
            for tensor in _made_on_the_prefetch_stream(flat, gathered):
                tensor.record_stream(stream)
        slots = family._slots[self.rank][index]
        for name, value in gathered.items():
            _set(slots[name], value)

    def release(self, index: int) -> None:
        self.family.drop_unowned(self.rank, index)
