"""Every way we know to write into the read-only base, on each kind of base: each one raises
ReadOnlyWeightError (the project's error) and the base stays bit-identical. On a file mapped
read-only (the default base) the ways run in a child process, so that a way the guard missed
shows up as a failed test (a segmentation fault there), not as a crashed test run.

The last section writes through views of an opened file: in-place ops, concurrent rank threads,
numpy views, and a replica's module weights."""

from __future__ import annotations

import copy
import os
import pickle
import signal
import subprocess
import sys
from multiprocessing.reduction import ForkingPickler
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import save_file

from comfy.multidevice.comm.group import SequenceParallelCoordinator
from comfy.multidevice.weights.safetensors_header import CheckpointError
from comfy.multidevice.weights.checkpoint import SharedCheckpoint, clear_shared_checkpoints
from comfy.multidevice.weights.read_only import ReadOnlyWeightError, is_read_only
from comfy.multidevice.weights.replicas import RankReplica
from tests.weights.weight_cases import THREAD_LIMIT_S, tiny_reference, write

REPO = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.filterwarnings("ignore:TypedStorage is deprecated")  # .storage() ways


def _disable_subclass(t):
    with torch._C.DisableTorchFunctionSubclass():
        t.add_(1)


def _disable_all(t):
    with torch._C.DisableTorchFunction():
        t.mul_(2)


def _del_tag(t):
    del t._ro_tag
    t.add_(1)


def _clear_dict(t):
    t.__dict__.clear()
    t.sub_(1)


def _set_source(t):
    alias = torch.empty(0, dtype=t.dtype)
    alias.set_(t)
    alias.fill_(0)


def _optimizer_step(p):
    p.requires_grad_(True)
    (p * p).sum().backward()
    torch.optim.SGD([p], lr=0.1).step()


def _batch(channels=4):
    return torch.randn(3, channels, generator=torch.Generator().manual_seed(5))


def _batch_norm_module_step(t):
    norm = torch.nn.BatchNorm1d(4).train()
    norm.running_mean = t  # the base's running stats as the module's buffers (a frozen norm layer)
    norm(_batch())


def _gather_stats(op, t, *count):
    # (input, mean, invstd, running_mean, running_var, momentum, eps, count): sync batch norm's update
    op(_batch(), torch.zeros(1, 4), torch.ones(1, 4), t, torch.ones(4), 0.1, 1e-5, *count)


def _reduce_tensor_rebuild(t):
    from torch.multiprocessing.reductions import reduce_tensor
    rebuild, args = reduce_tensor(t)  # what torch.multiprocessing sends, rebuilt here
    rebuild(*args).zero_()


# Sending a view to a process with multiprocessing's ForkingPickler (queues, pipes, spawn; loaded
# here in the same process): torch's reduction moved the base's memory into writable shared memory.
PROCESS_WAYS = {
    "ForkingPickler round trip": (lambda t: pickle.loads(ForkingPickler.dumps(t)).zero_(), False),
    "ForkingPickler round trip (param)": (lambda p: pickle.loads(ForkingPickler.dumps(p)).data.zero_(), True),
    "ForkingPickler(storage())": (lambda t: pickle.loads(ForkingPickler.dumps(t.storage())).fill_(0), False),
    "reduce_tensor + rebuild": (_reduce_tensor_rebuild, False),
    "storage()._share_fd_cpu_": (lambda t: t.storage()._share_fd_cpu_(), False),
}


# Ops that update batch norm's running stats without their schema marking the write (UNMARKED_WRITES
# of read_only.py). The cuDNN, MIOpen and gather-stats ops have no CPU kernel: on CPU the guard's
# refusal comes first (before it, torch said it has no such kernel); on a card they write.
BATCH_NORM_WAYS = {
    "F.batch_norm(training) running_mean": lambda t: F.batch_norm(_batch(), t, torch.ones(4), training=True),
    "F.batch_norm(training) running_var": lambda t: F.batch_norm(_batch(), torch.zeros(4), t, training=True),
    "BatchNorm1d.train() forward": _batch_norm_module_step,
    "F.instance_norm(use_input_stats)": lambda t: F.instance_norm(_batch().view(1, 4, 3), t, torch.ones(4),
                                                                   use_input_stats=True),
    "aten.native_batch_norm": lambda t: torch.ops.aten.native_batch_norm(_batch(), None, None, t, torch.ones(4),
                                                                         True, 0.1, 1e-5),
    "aten.batch_norm_update_stats": lambda t: torch.ops.aten.batch_norm_update_stats(_batch(), t, torch.ones(4),
                                                                                     0.1),
    "aten.cudnn_batch_norm": lambda t: torch.ops.aten.cudnn_batch_norm(_batch(), torch.ones(4), None, t,
                                                                       torch.ones(4), True, 0.1, 1e-5),
    "aten.miopen_batch_norm": lambda t: torch.ops.aten.miopen_batch_norm(_batch(), torch.ones(4), None, t,
                                                                         torch.ones(4), True, 0.1, 1e-5),
    "aten.batch_norm_gather_stats": lambda t: _gather_stats(torch.ops.aten.batch_norm_gather_stats, t, 3),
    "aten.batch_norm_gather_stats_with_counts": lambda t: _gather_stats(
        torch.ops.aten.batch_norm_gather_stats_with_counts, t, torch.full((1,), 3.0)),
}


# name -> (write attempt, whether it takes the replica parameter rather than the view)
WAYS = {
    "copy.copy(view)": (lambda t: copy.copy(t).add_(1), False),
    "copy.copy(param)": (lambda p: copy.copy(p).add_(1), True),
    "copy.copy(slice)": (lambda t: copy.copy(t[1:]).zero_(), False),
    "storage().fill_": (lambda t: t.storage().fill_(0), False),
    "storage()[i] =": (lambda t: t.storage().__setitem__(0, 1.0), False),
    "storage().copy_": (lambda t: t.storage().copy_(torch.zeros(t.numel()).storage()), False),
    "Tensor.storage(t).fill_": (lambda t: torch.Tensor.storage(t).fill_(0), False),
    "param.storage()[i] =": (lambda p: p.storage().__setitem__(1, 2.0), True),
    "_make_subclass(Tensor)": (lambda t: torch.Tensor._make_subclass(torch.Tensor, t).add_(1), False),
    "del view._ro_tag": (_del_tag, False),
    "view.__dict__.clear()": (_clear_dict, False),
    "DisableTorchFunctionSubclass": (_disable_subclass, False),
    "DisableTorchFunction": (_disable_all, False),
    "TensorBase.add_": (lambda t: torch._C.TensorBase.add_(t, 1), False),
    "torch.ops.aten.add_": (lambda t: torch.ops.aten.add_.Tensor(t, 1), False),
    "alias.set_(view)": (_set_source, False),
    "dtype view write": (lambda t: t.view(torch.uint8).__setitem__(0, 7), False),
    "as_strided write": (lambda t: torch.as_strided(t, (2,), (1,)).fill_(3), False),
    "param.data.add_": (lambda p: p.data.add_(1), True),
    "optimizer step": (_optimizer_step, True),
    "apply_": (lambda t: t.apply_(lambda x: 0.0), False),
    **{way: (fn, False) for way, fn in BATCH_NORM_WAYS.items()},
    **PROCESS_WAYS,
}


def _bases(tmp: Path, tensors: dict) -> dict:
    path = tmp / "w.safetensors"
    save_file(tensors, str(path))
    return {"pin": lambda: SharedCheckpoint.open(path, mode="pin"),
            "memory": lambda: SharedCheckpoint.from_state_dict(tensors)}


def _attempt(base, way: str) -> str:
    """Run one way on a fresh view (or replica parameter) of base['w']; 'refused' or what happened."""
    fn, wants_param = WAYS[way]
    view = base["w"]
    target = torch.nn.Parameter(view, requires_grad=False) if wants_param else view
    try:
        fn(target)
    except ReadOnlyWeightError:
        return "refused"
    except Exception as exc:  # noqa: BLE001 - reported, the test names it
        return f"{type(exc).__name__}: {exc}"[:200]
    return "no error"


def _tensors():
    g = torch.Generator().manual_seed(3)
    return {"w": torch.randn(4, generator=g), "other": torch.randn(3, 2, generator=g)}


@pytest.mark.parametrize("kind", ["pin", "memory"])
@pytest.mark.parametrize("way", sorted(WAYS))
def test_every_write_way_is_refused_and_the_base_unchanged(tmp_path, kind, way):
    clear_shared_checkpoints()
    tensors = _tensors()
    base = _bases(tmp_path, tensors)[kind]()
    assert _attempt(base, way) == "refused"
    for name, value in tensors.items():
        assert torch.equal(base[name], value), f"{way} changed {name!r} of the {kind} base"


CHILD = r"""
import sys, torch
sys.path.insert(0, sys.argv[1])
from tests.weights.test_read_only import WAYS, _attempt, _tensors
from comfy.multidevice.weights.checkpoint import SharedCheckpoint
base = SharedCheckpoint.open(sys.argv[2])
assert base.mode == "map", base.mode
written = _tensors()
for way in sorted(WAYS):
    print(way, "=>", _attempt(base, way), flush=True)
    assert all(torch.equal(base[n], v) for n, v in written.items()), way
print("base unchanged")
"""


def test_every_write_way_on_the_mapped_file_is_refused_before_it_faults(tmp_path):
    path = tmp_path / "w.safetensors"
    save_file(_tensors(), str(path))
    done = subprocess.run([sys.executable, "-c", CHILD, str(REPO), str(path)],
                          capture_output=True, text=True, timeout=120)
    lines = done.stdout.splitlines()
    assert done.returncode == 0, f"rc {done.returncode}; last lines: {lines[-3:]} {done.stderr[-600:]}"
    assert lines[-1] == "base unchanged"
    results = dict(line.split(" => ", 1) for line in lines[:-1])
    assert results == {way: "refused" for way in WAYS}


# Ops with a running_mean / running_var argument their schema leaves unmarked that only read it:
# backward passes, inference variants, and functional variants (they return new running stats).
RUNNING_STATS_READERS = {
    "aten::_batch_norm_impl_index_backward", "aten::_batch_norm_no_update",
    "aten::_batch_norm_with_update_functional", "aten::_native_batch_norm_legit_functional",
    "aten::_native_batch_norm_legit_no_training", "aten::batch_norm_backward",
    "aten::cudnn_batch_norm_backward", "aten::miopen_batch_norm_backward", "aten::native_batch_norm_backward",
}


def test_every_unmarked_running_stats_op_is_listed():
    """The search that found UNMARKED_WRITES, repeated over this torch's schemas: an op that takes
    running stats without marking them written is either refused on a base or known to only read."""
    from comfy.multidevice.weights.op_writes import UNMARKED_WRITES
    found = {s.name for s in torch._C._jit_get_all_schemas()
             for a in s.arguments
             if a.name in ("running_mean", "running_var") and a.alias_info is None}
    assert found - RUNNING_STATS_READERS - set(UNMARKED_WRITES) == set()
    assert not RUNNING_STATS_READERS & set(UNMARKED_WRITES)


def test_batch_norm_in_inference_reads_the_base_running_stats(tmp_path):
    """Only a training step writes the running stats: inference (a frozen norm layer) reads them."""
    base = _bases(tmp_path, {"mean": torch.full((4,), 0.5), "var": torch.full((4,), 2.0)})["pin"]()
    expected = F.batch_norm(_batch(), torch.full((4,), 0.5), torch.full((4,), 2.0))
    assert torch.equal(F.batch_norm(_batch(), base["mean"], base["var"]), expected)
    norm = torch.nn.BatchNorm1d(4).eval()
    norm.running_mean, norm.running_var = base["mean"], base["var"]
    assert torch.allclose(norm(_batch()), expected)
    assert torch.equal(base["mean"], torch.full((4,), 0.5)) and torch.equal(base["var"], torch.full((4,), 2.0))


RECEIVER = r"""
import ctypes, pickle, sys
sys.path.insert(0, sys.argv[1])
from comfy.multidevice.weights.read_only import ReadOnlyWeightError, is_read_only
sent = pickle.loads(sys.stdin.buffer.read())
view, param = sent["view"], sent["param"]
print("read-only", is_read_only(view), is_read_only(param), type(param).__name__, param.requires_grad)
print("values", view.tolist(), param.tolist())
for t in (view, param):
    try:
        t.data.zero_()
        print("written")
    except ReadOnlyWeightError:
        print("refused")
print("raw write", flush=True)
ctypes.memset(view.data_ptr(), 0, 4)  # the receiver's base is the file mapped read-only: faults
print("raw write went through", flush=True)
"""


@pytest.mark.parametrize("mode", ["map", "pin"])
def test_a_view_sent_to_another_process_is_that_process_own_read_only_base(tmp_path, mode):
    """ForkingPickler sends a view as a reference to its file: the receiver opens the file as its
    own read-only base (mapped: a raw write faults there); the sender's base stays the file's
    read-only mapping (torch's reduction would have moved it into writable shared memory)."""
    clear_shared_checkpoints()
    tensors = _tensors()
    path = tmp_path / "w.safetensors"
    save_file(tensors, str(path))
    base = SharedCheckpoint.open(path, mode=mode)
    view = base["other"].t()[1:]  # a derived view: (2, 3) -> its second row
    param = torch.nn.Parameter(base["w"], requires_grad=True)
    before = base["w"].data_ptr()
    data = ForkingPickler.dumps({"view": view, "param": param})
    assert base["w"].data_ptr() == before and is_read_only(base["w"])
    done = subprocess.run([sys.executable, "-c", RECEIVER, str(REPO)], input=bytes(data),
                          capture_output=True, timeout=120)
    lines = done.stdout.decode().splitlines()
    assert lines[:4] == ["read-only True True ReadOnlyTensor True",
                         f"values {tensors['other'].t()[1:].tolist()} {tensors['w'].tolist()}",
                         "refused", "refused"], (lines, done.stderr.decode()[-800:])
    if mode == "map":
        assert done.returncode == -signal.SIGSEGV and lines[4:] == ["raw write"], lines
    else:  # the receiver's own pinned copy: a raw write changes that process's RAM only
        assert done.returncode == 0, done.stderr.decode()[-800:]
    for name, value in tensors.items():
        assert torch.equal(base[name], value) and torch.equal(SharedCheckpoint.open(path)[name], value)


def test_a_view_of_an_in_memory_base_refuses_to_be_sent_to_another_process():
    base = SharedCheckpoint.from_state_dict(_tensors())
    with pytest.raises(ReadOnlyWeightError, match=r"tensor 'w' of in-memory state dict.*t\.clone\(\)"):
        ForkingPickler.dumps(base["w"])
    assert torch.equal(base["w"], _tensors()["w"])


def test_a_view_sent_before_its_file_was_replaced_is_refused_on_arrival(tmp_path):
    clear_shared_checkpoints()
    path = tmp_path / "w.safetensors"
    save_file(_tensors(), str(path))
    base = SharedCheckpoint.open(path)
    data = ForkingPickler.dumps(base["w"])
    save_file({"w": torch.zeros(4)}, str(tmp_path / "new.safetensors"))
    os.replace(tmp_path / "new.safetensors", path)
    with pytest.raises(CheckpointError, match="changed"):
        pickle.loads(data)


@pytest.mark.parametrize("kind", ["map", "pin", "memory"])
def test_plain_pickle_torch_save_and_deepcopy_give_independent_writable_copies(tmp_path, kind):
    """Not for another process's memory: each gives an ordinary tensor with its own memory."""
    clear_shared_checkpoints()
    tensors = _tensors()
    path = tmp_path / "w.safetensors"
    save_file(tensors, str(path))
    base = (SharedCheckpoint.from_state_dict(tensors) if kind == "memory"
            else SharedCheckpoint.open(path, mode=kind))
    w = base["w"]
    copies = {"pickle": pickle.loads(pickle.dumps(w)), "torch.save": torch.load(_saved(w, tmp_path)),
              "deepcopy": copy.deepcopy(w)}
    for how, c in copies.items():
        assert type(c) is torch.Tensor and not is_read_only(c) and c.data_ptr() != w.data_ptr(), how
        c.zero_()
    storage = pickle.loads(pickle.dumps(w.storage()))
    assert isinstance(storage, torch.TypedStorage)
    storage.fill_(0)
    for name, value in tensors.items():
        assert torch.equal(base[name], value)


def test_torch_itself_refuses_a_parameter_alias_of_a_view(tmp_path):
    base = _bases(tmp_path, _tensors())["pin"]()
    with pytest.raises(RuntimeError, match="already associated"):  # no alias is made, nothing written
        torch.Tensor._make_subclass(torch.nn.Parameter, base["w"])
    assert torch.equal(base["w"], _tensors()["w"])


def test_a_raw_write_into_the_mapped_base_faults_instead_of_changing_it(tmp_path):
    """What the guard cannot see (a raw pointer) hits PROT_READ pages: the process gets
    SIGSEGV, and no other rank or later open ever sees a changed weight."""
    path = tmp_path / "w.safetensors"
    save_file(_tensors(), str(path))
    child = ("import sys, ctypes; sys.path.insert(0, sys.argv[1]);"
             "from comfy.multidevice.weights.checkpoint import SharedCheckpoint;"
             "w = SharedCheckpoint.open(sys.argv[2])['w'];"
             "ctypes.memset(w.data_ptr(), 0, 4); print('wrote')")
    done = subprocess.run([sys.executable, "-c", child, str(REPO), str(path)],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == -signal.SIGSEGV and "wrote" not in done.stdout
    assert torch.equal(SharedCheckpoint.open(path)["w"], _tensors()["w"])


def test_reads_copies_and_documented_behaviour(tmp_path):
    """What docs/weights.md promises beside the refused writes."""
    tensors = _tensors()
    path = tmp_path / "w.safetensors"
    save_file(tensors, str(path))
    w = SharedCheckpoint.open(path)["w"]
    shallow = copy.copy(w)
    assert is_read_only(shallow) and shallow.data_ptr() == w.data_ptr()
    assert w.to(torch.float32) is w                       # same device and dtype: the view itself
    assert w.to(torch.float32, copy=True).add_(1) is not None  # an explicit copy is writable
    array = w.numpy()
    with pytest.raises(ValueError, match="read-only"):    # numpy's own error, not ours
        array[0] = 1.0
    assert w.tolist() == tensors["w"].tolist() and "ReadOnlyTensor" in repr(w)
    assert torch.equal(torch.load(_saved(w, tmp_path)), tensors["w"])  # pickles as a plain tensor


def _saved(t, tmp_path):
    out = tmp_path / "t.pt"
    torch.save(t, out)
    return out


def _dlpack(t):
    torch.from_dlpack(t.__dlpack__()).fill_(0)


def _from_numpy(t):
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch warns that the array is not writable
        torch.from_numpy(t.numpy()).fill_(0)


def _frombuffer(t):
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.frombuffer(t.numpy(), dtype=t.dtype).fill_(0)


def _assign_data(t):
    plain = torch.zeros(t.shape, dtype=t.dtype)
    plain.data = t   # the setter checks only `plain`
    plain.fill_(0)


def _ctypes(t):
    import ctypes
    ctypes.memset(t.data_ptr(), 0, t.nbytes)


# The unguarded ways that the "Not guarded" item of docs/weights.md lists, each shown to write:
# if a torch release starts refusing one, this test fails and that list must shrink.
UNGUARDED = {
    "untyped_storage().fill_": lambda t: t.untyped_storage().fill_(0),
    "storage()._untyped_storage": lambda t: t.storage()._typed._untyped_storage.fill_(0),
    "DLPack": _dlpack,
    "torch.from_numpy": _from_numpy,
    "torch.frombuffer": _frombuffer,
    "plain.data = view": _assign_data,
    "data_ptr + ctypes": _ctypes,
    "ForkingPickler(untyped_storage())": lambda t: pickle.loads(ForkingPickler.dumps(t.untyped_storage())).fill_(0),
}


# How each way of UNGUARDED is named in the "Not guarded" item of docs/weights.md.
UNGUARDED_IN_DOCS = ("untyped_storage()", "`.storage()`", "DLPack", "torch.from_numpy", "torch.frombuffer",
                     "`plain.data = w`", "data_ptr()", "`ForkingPickler` of `untyped_storage()`")


def test_the_docs_name_every_unguarded_way():
    """The "Not guarded" item of docs/weights.md is the list UNGUARDED tests: each way is named there."""
    text = (REPO / "docs" / "weights.md").read_text(encoding="utf-8")
    item = text.split("- **Not guarded**", 1)[1].split("\n- ", 1)[0]
    missing = [way for way in UNGUARDED_IN_DOCS if way not in item]
    assert not missing and len(UNGUARDED_IN_DOCS) == len(UNGUARDED), missing


@pytest.mark.parametrize("way", sorted(UNGUARDED))
def test_the_documented_unguarded_ways_do_write_an_in_memory_base(way):
    """On an in-memory (or pin) base these raw ways go through, as docs/weights.md says; on the
    mapped base they fault instead (test_a_raw_write_into_the_mapped_base_faults_...)."""
    base = SharedCheckpoint.from_state_dict({"w": torch.ones(4)})
    UNGUARDED[way](base["w"])
    assert not torch.equal(base["w"], torch.ones(4))


# ----------------------------------------------------------------------------- read-only views

WRITES = {
    "add_": lambda t: t.add_(1),
    "copy_": lambda t: t.copy_(torch.zeros_like(t)),
    "setitem": lambda t: t.__setitem__(0, 5.0),
    "out=": lambda t: torch.add(t, 1, out=t),
    "relu inplace": lambda t: torch.nn.functional.relu(t, inplace=True),
    "view then write": lambda t: t.view(-1).__setitem__(1, 9.0),
    "transpose mul_": lambda t: t.t().mul_(2),
    ".data add_": lambda t: t.data.add_(1),
    "detach fill_": lambda t: t.detach().fill_(0),
    "init zeros_": lambda t: torch.nn.init.zeros_(t),
    "resize_": lambda t: t.resize_(1000),
    "iadd": lambda t: t.__iadd__(1),
    "foreach": lambda t: torch._foreach_add_([t], 1.0),
    "index_put_": lambda t: t.index_put_((torch.tensor([0]),), torch.tensor(1.0)),
    "masked_fill_": lambda t: t.masked_fill_(t > 0, 0),
    "split piece": lambda t: t.split(1)[0].zero_(),
    "unbind piece": lambda t: t.unbind(0)[1].neg_(),
    "share_memory_": lambda t: t.share_memory_(),
    "as_subclass": lambda t: t.as_subclass(torch.Tensor),
    "in inference mode": lambda t: _in_inference(lambda: t.sub_(1)),
}


def _in_inference(fn):
    with torch.inference_mode():
        fn()


@pytest.mark.parametrize("how", sorted(WRITES))
def test_write_attempt_raises_and_base_is_unchanged(tmp_path, how):
    written = {"w": torch.randn(4, 3), "v": torch.randn(5)}
    path = write(tmp_path / "m.safetensors", written)
    ckpt = SharedCheckpoint.open(path)
    with pytest.raises(ReadOnlyWeightError, match=r"tensor 'w' of .*m\.safetensors"):
        WRITES[how](ckpt["w"])
    assert torch.equal(ckpt["w"], written["w"]) and torch.equal(ckpt["v"], written["v"])


def test_guard_is_per_thread_under_concurrent_rank_threads(tmp_path):
    written = {"w": torch.randn(64, 64)}
    ckpt = SharedCheckpoint.open(write(tmp_path / "m.safetensors", written))
    x = torch.randn(8, 64)

    def hammer(rank, comm):
        w, refused = ckpt["w"], 0
        for i in range(200):
            y = torch.nn.functional.linear(x, w)          # reads are fine
            assert torch.equal(y, torch.nn.functional.linear(x, written["w"]))
            try:
                w[i % 64].add_(1.0)
            except ReadOnlyWeightError:
                refused += 1
        return refused, torch._C._len_torch_dispatch_stack()

    with SequenceParallelCoordinator(["cpu"] * 4, backend="peer", timeout_s=THREAD_LIMIT_S) as coord:
        results = coord.run(hammer)
    assert results == [(200, 0)] * 4          # every write refused, no mode left on any thread
    assert torch.equal(ckpt["w"], written["w"])


def test_numpy_views_are_read_only_and_copies_are_writable(tmp_path):
    written = {"w": torch.randn(4, 3)}
    ckpt = SharedCheckpoint.open(write(tmp_path / "m.safetensors", written))
    import numpy as np
    for array in (ckpt["w"].numpy(), np.asarray(ckpt["w"])):
        with pytest.raises(ValueError, match="read-only"):
            array[0, 0] = 1.0
    clone = ckpt["w"].clone()
    clone.add_(1)                               # a copy is private and writable
    deep = copy.deepcopy(ckpt["w"])
    deep.mul_(0)
    moved = ckpt["w"].to(torch.float64)
    moved.add_(1)
    assert not any(is_read_only(t) for t in (clone, deep, moved))
    assert torch.equal(ckpt["w"], written["w"])


def test_replica_module_weights_refuse_writes(tmp_path):
    ref = tiny_reference()
    ckpt = SharedCheckpoint.open(write(tmp_path / "m.safetensors", ref.state_dict()))
    replica = RankReplica(ckpt, "cpu", template=ref).load()
    with pytest.raises(ReadOnlyWeightError):
        replica.module.embed.weight.data.mul_(2)
    with pytest.raises(RuntimeError, match="read-only"):  # load_state_dict wraps the error
        replica.module.load_state_dict({k: torch.zeros_like(v) for k, v in ref.state_dict().items()})
    assert torch.equal(ckpt["embed.weight"], ref.embed.weight)


# ----------------------------------------------------------------------------- copies that only read

DISPATCH_IMPORT_PROBE = """
import sys, torch
from safetensors.torch import save_file
from comfy.multidevice.weights.checkpoint import SharedCheckpoint
from comfy.multidevice.weights.replicas import RankReplica
path = sys.argv[1]
save_file({"w": torch.arange(6.0).view(2, 3).to(torch.bfloat16), "b": torch.ones(3, dtype=torch.bfloat16)}, path)
base = SharedCheckpoint.open(path)
replica = RankReplica(base, "cpu", dtype=torch.float32).load()
weights = replica.state_dict()
print("dispatch modules imported:", "torch.distributed.tensor" in sys.modules)
assert all(type(t) is torch.Tensor and t.dtype == torch.float32 for t in weights.values()), weights
assert torch.equal(weights["w"], torch.arange(6.0).view(2, 3)) and torch.equal(weights["b"], torch.ones(3))
weights["w"].add_(1)  # the copy is the rank's own: writable, and the base keeps its bytes
assert torch.equal(base["w"].float(), torch.arange(6.0).view(2, 3))
"""


@pytest.mark.timeout(120)
def test_a_rank_whose_weights_are_copies_never_dispatches_on_the_base(tmp_path):
    """A replica in another dtype (or on a card) copies its weights from plain aliases of the
    base: no op dispatches on a read-only view while it loads, so a fresh process does not pay
    torch's one-time import for dispatch subclasses (torch.distributed.tensor, ~0.4 s and ~40 MB)
    for them. The copies are plain, writable and equal to the stored values; the base is unchanged."""
    done = subprocess.run([sys.executable, "-c", DISPATCH_IMPORT_PROBE, str(tmp_path / "w.safetensors")],
                          capture_output=True, text=True, cwd=REPO, timeout=110)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "dispatch modules imported: False" in done.stdout, done.stdout
