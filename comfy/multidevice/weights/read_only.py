"""Zero-copy tensor views of memory that must not be written.

torch has no read-only tensors. The views handed out by the shared checkpoint are a small
tensor subclass, ReadOnlyTensor, and the storages they point into are registered as guarded
(process-wide, for as long as their ReadOnlyMemory record lives). Writes are refused with
ReadOnlyWeightError before they happen, on two levels:

- `__torch_dispatch__`: every ATen op on a view reaches it, also when `__torch_function__`
  is skipped (under DisableTorchFunctionSubclass, `torch._C` methods, a plain alias made by
  `Tensor._make_subclass`, which keeps the view's dispatch keys). It reads the op's schema
  and refuses any op that would write into a guarded storage (add_, copy_, index assignment,
  out=..., F.relu(inplace=True), set_, resize_ ...), also through a plain tensor aliasing it
  that takes part in the same op, and `set_` that would make a plain tensor alias one. Some
  kernels write an argument their schema does not mark (batch norm in training updates
  running_mean / running_var in place): weights/op_writes.py reads the schema and lists those
  kernels; in inference the running stats are only read and pass.
- `__torch_function__`: methods that change a tensor without a writing ATen op (names ending
  in `_` such as share_memory_), and the wrapping of results (views of a view are views).

Views derived from a view (slicing, .t(), .detach(), .data, .view, copy.copy ...) are guarded
too; copies (.clone(), .to(other device or dtype), deepcopy) are plain, writable tensors; a
same-device, same-dtype .to() returns the view itself, as torch does. .storage() gives a
read-only wrapper of the TypedStorage (reads pass, writes are refused); numpy() / __array__ give arrays flagged read-only (numpy
refuses writes into those with its own ValueError); as_subclass to another class raises.
Whether a tensor is guarded is decided by its storage, not by an attribute that could be
deleted. Each view holds its ReadOnlyMemory, which holds the storage: the memory stays valid
as long as any view is alive.

Pickling: multiprocessing's ForkingPickler (queues, pipes, spawn; torch.multiprocessing adds its
reductions there) would move a view's memory, in place, into writable shared memory. A view
goes as a reference to its file instead (see "sending a view to another process" below): the
receiver opens the same file as its own read-only base; a view of a base that no file backs
refuses to be sent (ReadOnlyWeightError: send t.clone()), as does .storage(), and torch's
reduce_tensor(view) called directly (it reaches for storage()._untyped_storage, refused). Plain
pickle, torch.save and deepcopy copy by value: an independent, writable tensor.

Raw access (data_ptr, untyped_storage(), DLPack, torch.from_numpy / frombuffer over the
memory, ctypes, `plain.data = view`, whose setter checks only `plain`, ForkingPickler of
untyped_storage()) bypasses the guard; model code does not write through those by accident. A
file-backed base maps the file read-only, so a raw write there is a segmentation fault rather
than a silent change of every rank's weights.
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from multiprocessing.reduction import ForkingPickler
from typing import Any, NamedTuple

import torch
from torch._C import DisableTorchFunctionSubclass, DispatchKey, DispatchKeySet
from torch.utils._python_dispatch import _len_torch_dispatch_stack, _pop_mode, _push_mode

from comfy.multidevice.weights.op_writes import leaves, written_tensors


class ReadOnlyWeightError(RuntimeError):
    """An in-place write into shared read-only checkpoint memory was attempted (and refused)."""


class ReadOnlyMemory:
    """A block of read-only memory: its storage and a label for messages. While the record
    lives its storage is guarded: every tensor over it refuses writes (see the module doc)."""

    __slots__ = ("storage", "cdata", "label", "__weakref__")

    def __init__(self, storage: torch.UntypedStorage, label: str):
        self.storage = storage      # keeps the memory alive as long as this record lives
        self.cdata = storage._cdata  # identity of the storage (stable while it lives)
        self.label = label
        _register(self)

    def contains_address(self, address: int) -> bool:
        start = self.storage.data_ptr()
        return start <= address < start + self.storage.nbytes()


# storage id -> live records over that storage. A record keeps its storage alive, so an id
# cannot be reused while any record of it lives; dead records are pruned on the way.
_guarded_lock = threading.RLock()  # re-entrant: a weakref callback may run inside (GC)
_guarded: dict[int, list[weakref.ref]] = {}


def _register(memory: ReadOnlyMemory) -> None:
    def forget(ref, cdata=memory.cdata):
        with _guarded_lock:
            refs = [r for r in _guarded.get(cdata, ()) if r is not ref and r() is not None]
            if refs:
                _guarded[cdata] = refs
            else:
                _guarded.pop(cdata, None)

    with _guarded_lock:
        _guarded.setdefault(memory.cdata, []).append(weakref.ref(memory, forget))


def _storage_guard(storage_id: int | None, what: str) -> "_Tag | None":
    """A guard over the live ReadOnlyMemory of the storage with this id, if any; `what` stands
    for the tensor's name in messages (no view of the checkpoint names it)."""
    for ref in _guarded.get(storage_id, ()) if storage_id is not None else ():
        memory = ref()
        if memory is not None:
            return _Tag(memory, what, None)
    return None


def _storage_id(t: torch.Tensor) -> int | None:
    try:
        return t.untyped_storage()._cdata
    except (RuntimeError, NotImplementedError, TypeError):  # sparse, nested, ... have no plain storage
        return None


class _Tag(NamedTuple):
    """What a guarded view points into. `owner` (e.g. the SharedCheckpoint) is kept alive by
    every view so that the source is reused while anything still uses its memory; the owner
    holds the memory but never the views, so there is no reference cycle."""
    memory: ReadOnlyMemory
    name: str
    owner: Any


def read_only_view(tensor: torch.Tensor, memory: ReadOnlyMemory, name: str,
                   owner: Any = None) -> "ReadOnlyTensor":
    """Wrap `tensor` (a plain tensor aliasing memory.storage) as a guarded view named `name`."""
    return _tagged_view(tensor, _Tag(memory, name, owner))


def _tagged_view(tensor: torch.Tensor, tag: _Tag) -> "ReadOnlyTensor":
    with DisableTorchFunctionSubclass():
        if _storage_id(tensor) != tag.memory.cdata:
            raise ValueError(f"read_only_view({tag.name!r}): the tensor does not alias {tag.memory.label}")
        view = torch.Tensor.as_subclass(tensor, ReadOnlyTensor)
    view.__dict__["_ro_tag"] = tag
    return view


def _below_python_dispatch():
    """Run ops below the Python dispatch key (inside our __torch_dispatch__: the real kernels)."""
    return torch._C._ExcludeDispatchKeyGuard(
        DispatchKeySet(DispatchKey.Python).add(DispatchKey.PythonTLSSnapshot))


def _tag_of(t: torch.Tensor) -> _Tag | None:
    """The guard of a tensor over guarded memory (its own tag when it has one), else None."""
    with DisableTorchFunctionSubclass():
        storage_id = _storage_id(t)
    tag = t.__dict__.get("_ro_tag") if isinstance(t, ReadOnlyTensor) else None
    if tag is not None and tag.memory.cdata == storage_id:
        return tag
    return _storage_guard(storage_id, "(an alias of a read-only view)")


def _guards(values: Any, kind: type) -> dict[int, _Tag]:
    """storage id -> guard of the tensors of type `kind` in `values` (nested) over guarded memory."""
    guarded: dict[int, _Tag] = {}
    for t in leaves(values):
        tag = _tag_of(t) if isinstance(t, kind) else None
        if tag is not None:
            guarded.setdefault(tag.memory.cdata, tag)
    return guarded


def is_read_only(t: Any) -> bool:
    """True when `t` is a guarded view that still points into its read-only memory."""
    return isinstance(t, ReadOnlyTensor) and t._guard() is not None


def _check_writes(func, args, kwargs) -> None:
    """Refuse the ATen op `func` if it would write into a guarded storage, or (set_) make a
    tensor outside the guard alias one."""
    if getattr(getattr(func, "_schema", None), "name", None) == "aten::set_":
        for source in leaves((args[1:], kwargs)):
            tag = (_tag_of(source) if isinstance(source, torch.Tensor)
                   else _storage_guard(getattr(source, "_cdata", None), "(a storage of a read-only view)"))
            if tag is not None:
                _refuse(f"{func} onto it (it would make a writable alias)", tag)
    for name, t in written_tensors(func, args, kwargs):
        tag = _tag_of(t)
        if tag is not None:
            _refuse(f"in-place op {func} (its argument {name})", tag)


def _refuse(what: str, tag: _Tag):
    memory, name = tag.memory, tag.name
    raise ReadOnlyWeightError(
        f"{what} would write into tensor {name!r} of {memory.label}, which is shared read-only "
        "memory (every replica is built from it); make a private copy first (t.clone() or "
        "t.to(device)) or patch out of place (w = w + delta)")


# Methods that mutate a tensor object without a guarded ATen op (storage swaps and the like),
# refused by name when their first argument is guarded. requires_grad_ only flips a flag.
_ALLOWED_TRAILING_UNDERSCORE = frozenset({"requires_grad_"})


class ReadOnlyTensor(torch.Tensor):
    """A zero-copy view of read-only memory; see the module docstring."""

    _ro_tag: _Tag

    def _guard(self) -> _Tag | None:
        # Decided by the storage: `t.data = other` or set_() re-point the object elsewhere
        # (then it is not guarded); deleting the tag does not unguard it.
        return _tag_of(self)

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        guarded = _guards((args, kwargs), ReadOnlyTensor)
        if not guarded:
            with DisableTorchFunctionSubclass():
                return func(*args, **kwargs)

        name = getattr(func, "__name__", "")
        if (name.endswith("_") and not name.startswith("__")
                and name not in _ALLOWED_TRAILING_UNDERSCORE and args):
            for tag in _guards(args[0], ReadOnlyTensor).values():
                _refuse(f"in-place {name}()", tag)

        with DisableTorchFunctionSubclass():
            out = func(*args, **kwargs)  # every ATen op it runs is checked by __torch_dispatch__
            return _guard_outputs(out, guarded)

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        # Reached for every ATen op on a view, also when __torch_function__ was skipped.
        kwargs = kwargs or {}
        _check_writes(func, args, kwargs)
        guarded = _guards((args, kwargs), torch.Tensor)
        with _below_python_dispatch():
            out = func(*args, **kwargs)
        return _guard_outputs(out, guarded)

    def __copy__(self):
        # copy.copy of a tensor shares its memory: the shallow copy is a guarded view too.
        with DisableTorchFunctionSubclass():
            alias = torch.Tensor.detach(self)
        alias.requires_grad_(self.requires_grad)
        if self.__dict__.get("_is_param", False):
            alias._is_param = True
        return alias

    def numpy(self, *, force: bool = False):
        # torch refuses .numpy() on a dispatch subclass: an array over a plain alias, read-only.
        tag = self._guard()
        array = _plain_alias(self).numpy(force=force)
        if tag is not None:
            array.flags.writeable = False
        return array

    def tolist(self):
        return _plain_alias(self).tolist()  # refused on a dispatch subclass, like numpy()

    def as_subclass(self, cls):
        if isinstance(cls, type) and issubclass(cls, ReadOnlyTensor):
            return self
        tag = self._guard()
        if tag is None:
            with DisableTorchFunctionSubclass():
                return torch.Tensor.as_subclass(self, cls)
        _refuse(f"as_subclass({getattr(cls, '__name__', cls)})", tag)

    def __deepcopy__(self, memo):
        # A deep copy is a private, writable copy (Parameter-ness and requires_grad kept).
        if id(self) in memo:
            return memo[id(self)]
        requires_grad, is_param = self.requires_grad, self.__dict__.get("_is_param", False)
        with DisableTorchFunctionSubclass():
            copy = torch.Tensor.clone(torch.Tensor.detach(self))
        copy = torch.nn.Parameter(copy, requires_grad) if is_param else copy.requires_grad_(requires_grad)
        memo[id(self)] = copy
        return copy

    def __reduce_ex__(self, protocol):
        # Plain pickle (and torch.save) as a plain tensor, by value: the copy it loads as is
        # independent and writable. (The memory record, with its locks, is not picklable.)
        return _plain_alias(self).__reduce_ex__(protocol)

    def _typed_storage(self):
        # torch's own helpers reach the memory through this (torch.multiprocessing's
        # reduce_tensor, which would alias or share it writable): the guarded wrapper, as .storage().
        with DisableTorchFunctionSubclass():
            typed = torch.Tensor._typed_storage(self)
        tag = self._guard()
        return typed if tag is None else ReadOnlyTypedStorage(typed, tag)


@contextlib.contextmanager
def _no_dispatch_modes():
    """This thread's dispatch modes off for a moment (torch's own helper imports torch.fx)."""
    modes = [_pop_mode() for _ in range(_len_torch_dispatch_stack())]
    try:
        yield
    finally:
        for mode in reversed(modes):
            _push_mode(mode)


def moved(t: torch.Tensor, device, dtype: torch.dtype) -> torch.Tensor:
    """`t.to(device, dtype)`: `t` itself when that changes nothing (as .to() returns), else a
    plain copy. For a read-only view the copy is made from a plain alias of its memory, which
    is only read: no op dispatches on the subclass, so a rank whose weights are copies (on a
    card, or in another dtype) never pays torch's one-time import for dispatch subclasses (see
    weights/dispatch_warm_up.py), nor the guard's per-op Python."""
    target = torch.device(device)
    same_place = t.device.type == target.type and target.index in (None, t.device.index)
    if same_place and t.dtype == dtype:
        return t
    if isinstance(t, ReadOnlyTensor) and _tag_of(t) is not None:
        return _plain_alias(t).to(target, dtype)
    return t.to(target, dtype)


def _plain_alias(t: torch.Tensor) -> torch.Tensor:
    """A plain tensor over t's memory, without its dispatch keys (numpy, pickling, and copies that only read it)."""
    with DisableTorchFunctionSubclass():
        return _alias(torch.Tensor.untyped_storage(t), t.dtype, t.storage_offset(), t.size(), t.stride())


def _alias(storage: torch.UntypedStorage, dtype: torch.dtype, offset: int, size, stride) -> torch.Tensor:
    """A plain tensor over `storage`, made outside any dispatch mode (no mode sees the alias being made)."""
    with _no_dispatch_modes():
        return torch.empty(0, dtype=dtype).set_(storage, offset, size, stride)


def _byte_start(t: torch.Tensor) -> int:
    return t.storage_offset() * t.element_size()


# ---------------------------------------------------------------- sending a view to another process
# multiprocessing's ForkingPickler (queues, pipes, spawn arguments; torch.multiprocessing registers
# its reductions there) would send a tensor by moving its storage into writable shared memory:
# the base's memory itself, in place, under every replica. A view goes as a reference instead:
# its owner (the SharedCheckpoint) says how the receiver gets the named tensor from its own
# read-only base of the same file (owner.process_reference(name) -> (function, arguments), None
# when there is no file); the view's place relative to that tensor travels beside it.

def _refuse_sending(tag: _Tag, why: str):
    raise ReadOnlyWeightError(
        f"cannot send tensor {tag.name!r} of {tag.memory.label} to another process: {why}; "
        "send a private copy (t.clone()) instead")


def _reduce_for_process(view: "ReadOnlyTensor"):
    tag = view._guard()
    if tag is None:  # re-pointed at other memory (t.data = other): an ordinary tensor now
        return view.__reduce_ex__(2)
    reference = getattr(tag.owner, "process_reference", None)
    rebuild = reference(tag.name) if reference is not None else None
    if rebuild is None:
        _refuse_sending(tag, "it is shared read-only memory that no file backs, so it cannot travel as a "
                             "reference to the file, and torch would move it into writable shared memory")
    with DisableTorchFunctionSubclass():
        layout = (_byte_start(view) - _byte_start(tag.owner[tag.name]), view.dtype,
                  tuple(view.size()), tuple(view.stride()))
    return _rebuild_view, (rebuild, layout, view.requires_grad, view.__dict__.get("_is_param", False))


def _rebuild_view(rebuild, layout, requires_grad: bool, is_param: bool):
    """In the receiving process: the view that was sent, over this process's own read-only base."""
    function, arguments = rebuild
    named = function(*arguments)
    tag = named._guard()
    delta, dtype, size, stride = layout
    with DisableTorchFunctionSubclass():
        storage = torch.Tensor.untyped_storage(named)
        start = _byte_start(named) + delta
    extent = 0 if 0 in size else (1 + sum((n - 1) * st for n, st in zip(size, stride))) * dtype.itemsize
    if start < 0 or start % dtype.itemsize or start + extent > storage.nbytes():
        raise ReadOnlyWeightError(f"a view of tensor {tag.name!r} of {tag.memory.label} sent from another "
                                  "process does not lie inside this process's memory of it; send a "
                                  "private copy (t.clone()) instead")
    view = _tagged_view(_alias(storage, dtype, start // dtype.itemsize, size, stride), tag)
    return torch.nn.Parameter(view, requires_grad) if is_param else view.requires_grad_(requires_grad)


def _reduce_storage_for_process(storage: "ReadOnlyTypedStorage"):
    _refuse_sending(storage._ro_tag, "torch would move its storage() into writable shared memory; send "
                                     "the tensor itself (a view of a file travels as a reference)")


class ReadOnlyTypedStorage:
    """`.storage()` of a guarded view: a TypedStorage whose reads pass through and whose write
    methods are refused. (The storage it wraps, like `untyped_storage()`, is raw access.)"""

    __slots__ = ("_typed", "_ro_tag")

    def __init__(self, typed: torch.TypedStorage, tag: _Tag):
        object.__setattr__(self, "_typed", typed)
        object.__setattr__(self, "_ro_tag", tag)

    def __getattr__(self, name: str):
        if name in ReadOnlyTypedStorage.__slots__:  # not set yet (an object being unpickled)
            raise AttributeError(name)
        # fill_, copy_, resize_, _resize_, _share_fd_cpu_ (moves the memory into writable shared
        # memory) ...: every in-place method; and _untyped_storage, a writable handle that torch's
        # helpers (reduce_tensor) alias. (Raw access stays possible through untyped_storage().)
        if name == "_untyped_storage":
            _refuse("storage()._untyped_storage (a writable alias, as reduce_tensor makes)", self._ro_tag)
        if name.endswith("_") and not name.startswith("__"):
            _refuse(f"storage().{name}()", self._ro_tag)
        return getattr(self._typed, name)

    def __reduce_ex__(self, protocol):
        return self._typed.__reduce_ex__(protocol)  # by value: torch pickles a TypedStorage's bytes

    def __setattr__(self, name: str, value) -> None:
        _refuse(f"setting storage().{name}", self._ro_tag)

    def __setitem__(self, index, value):
        _refuse("storage item assignment", self._ro_tag)

    def __getitem__(self, index):
        return self._typed[index]

    def __len__(self) -> int:
        return len(self._typed)

    def __iter__(self):
        return iter(self._typed)

    def __repr__(self) -> str:
        return f"read-only {self._typed!r}"


def _guard_outputs(out: Any, guarded: dict[int, _Tag]) -> Any:
    """Wrap outputs aliasing guarded memory as guarded views; mark aliasing numpy arrays read-only."""
    if isinstance(out, ReadOnlyTensor):
        return out
    if isinstance(out, torch.Tensor):
        tag = guarded.get(_storage_id(out))
        return out if tag is None else _tagged_view(out, tag)
    if isinstance(out, torch.TypedStorage) and not isinstance(out, ReadOnlyTypedStorage):
        storage_id = out._untyped_storage._cdata  # t.storage(), Tensor.storage(t)
        tag = guarded.get(storage_id) or _storage_guard(storage_id, "(a storage of a read-only view)")
        return out if tag is None else ReadOnlyTypedStorage(out, tag)
    if isinstance(out, (tuple, list)):
        items = [_guard_outputs(o, guarded) for o in out]
        if all(a is b for a, b in zip(items, out)):
            return out
        return type(out)(items)
    if type(out).__module__ == "numpy" and hasattr(out, "__array_interface__"):
        address = out.__array_interface__["data"][0]
        if any(tag.memory.contains_address(address) for tag in guarded.values()):
            out.flags.writeable = False
    return out


ForkingPickler.register(ReadOnlyTensor, _reduce_for_process)
ForkingPickler.register(ReadOnlyTypedStorage, _reduce_storage_for_process)
