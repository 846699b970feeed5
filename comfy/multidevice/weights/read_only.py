"""Zero-copy tensor views of memory that must not be written.

torch has no read-only tensors, and a PROT_READ mapping would turn a stray in-place op
into a segfault. So the views handed out by the shared checkpoint are a small tensor
subclass, ReadOnlyTensor, over ordinary memory:

- Every torch call that involves such a view goes through `__torch_function__`, which
  runs the call under a dispatch mode that inspects each ATen op's schema and raises
  ReadOnlyWeightError *before* any op that would write into the guarded memory
  (add_, copy_, index assignment, out=..., F.relu(inplace=True), set_, resize_ ...).
- Views derived from a guarded view (slicing, .t(), .detach(), .data, .view ...) are
  guarded too; copies (.clone(), .to(other device or dtype)) are plain, writable tensors.
- numpy() / __array__ give numpy arrays flagged read-only; as_subclass to another class
  raises; deepcopy and pickling give plain copies.
- Each view holds its ReadOnlyMemory, which holds the storage: the memory stays valid as
  long as any view is alive.

Raw access (data_ptr, untyped_storage(), DLPack, torch.from_numpy of the read-only numpy
view, which torch only warns about) bypasses the guard; model code does not write through
those by accident.
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import torch
from torch._C import DisableTorchFunctionSubclass
from torch.utils._python_dispatch import _pop_mode, _push_mode, TorchDispatchMode


class ReadOnlyWeightError(RuntimeError):
    """An in-place write into shared read-only checkpoint memory was attempted (and refused)."""


class ReadOnlyMemory:
    """A block of read-only memory: its storage and a label for messages."""

    __slots__ = ("storage", "cdata", "label", "__weakref__")

    def __init__(self, storage: torch.UntypedStorage, label: str):
        self.storage = storage      # keeps the memory alive as long as this record lives
        self.cdata = storage._cdata  # identity of the storage (stable while it lives)
        self.label = label

    def contains_address(self, address: int) -> bool:
        start = self.storage.data_ptr()
        return start <= address < start + self.storage.nbytes()


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
    view._ro_tag = tag
    return view


def is_read_only(t: Any) -> bool:
    """True when `t` is a guarded view that still points into its read-only memory."""
    return isinstance(t, ReadOnlyTensor) and t._guard() is not None


def _leaves(value: Any):
    if isinstance(value, (list, tuple)):
        for v in value:
            yield from _leaves(v)
    elif isinstance(value, dict):
        for v in value.values():
            yield from _leaves(v)
    else:
        yield value


@functools.lru_cache(maxsize=None)
def _written_arguments(op) -> tuple[tuple[int, str, bool], ...]:
    """(position, name, keyword-only) of every argument the op's schema marks as written (a!)."""
    schema = getattr(op, "_schema", None)
    if schema is None:
        return ()
    return tuple((i, a.name, a.kwarg_only) for i, a in enumerate(schema.arguments)
                 if a.alias_info is not None and a.alias_info.is_write)


def _refuse(what: str, tag: _Tag):
    memory, name = tag.memory, tag.name
    raise ReadOnlyWeightError(
        f"{what} would write into tensor {name!r} of {memory.label}, which is shared read-only "
        "memory (every replica is built from it); make a private copy first (t.clone() or "
        "t.to(device)) or patch out of place (w = w + delta)")


class _WriteGuard(TorchDispatchMode):
    """Raises before any ATen op writes into one of the guarded storages."""

    def __init__(self, guarded: dict[int, _Tag]):
        super().__init__()
        self.guarded = guarded

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        # Nothing here is ever compiled; the default wrapping would import torch._dynamo on
        # first use (seconds and ~100 MB of resident memory).
        return False

    # The base class's __enter__/__exit__ also flip process-wide "inside a dispatch mode" flags,
    # which concurrent rank threads would leave wrong; the mode stack itself is per thread.
    def __enter__(self):
        _push_mode(self)
        return self

    def __exit__(self, *exc_info):
        _pop_mode()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        for position, name, kwarg_only in _written_arguments(func):
            value = kwargs.get(name) if kwarg_only or position >= len(args) else args[position]
            for t in _leaves(value):
                if isinstance(t, torch.Tensor):
                    hit = self.guarded.get(_storage_id(t))
                    if hit is not None:
                        _refuse(f"in-place op {func}", hit)
        return func(*args, **kwargs)


# Methods that mutate a tensor object without a guarded ATen op (storage swaps and the like),
# refused by name when their first argument is guarded. requires_grad_ only flips a flag.
_ALLOWED_TRAILING_UNDERSCORE = frozenset({"requires_grad_"})


class ReadOnlyTensor(torch.Tensor):
    """A zero-copy view of read-only memory; see the module docstring."""

    _ro_tag: _Tag

    def _guard(self) -> _Tag | None:
        tag = self.__dict__.get("_ro_tag")
        if tag is None:
            return None
        with DisableTorchFunctionSubclass():
            # `t.data = other` or set_() re-point the object elsewhere: then it is not guarded.
            if _storage_id(self) != tag.memory.cdata:
                return None
        return tag

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        guarded: dict[int, _Tag] = {}
        for t in _leaves((args, kwargs)):
            if isinstance(t, ReadOnlyTensor):
                tag = t._guard()
                if tag is not None:
                    guarded.setdefault(tag.memory.cdata, tag)
        if not guarded:
            with DisableTorchFunctionSubclass():
                return func(*args, **kwargs)

        name = getattr(func, "__name__", "")
        if (name.endswith("_") and not name.startswith("__")
                and name not in _ALLOWED_TRAILING_UNDERSCORE and args):
            for t in _leaves(args[0]):
                if isinstance(t, ReadOnlyTensor) and t._guard() is not None:
                    _refuse(f"in-place {name}()", t._guard())

        with DisableTorchFunctionSubclass():
            with _WriteGuard(guarded):
                out = func(*args, **kwargs)
            return _guard_outputs(out, guarded)

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
        # Pickle as a plain tensor: the memory record (locks, the checkpoint) is not picklable.
        with DisableTorchFunctionSubclass():
            plain = torch.Tensor.detach(self)
        return plain.__reduce_ex__(protocol)


def _guard_outputs(out: Any, guarded: dict[int, _Tag]) -> Any:
    """Wrap outputs aliasing guarded memory as guarded views; mark aliasing numpy arrays read-only."""
    if isinstance(out, ReadOnlyTensor):
        return out
    if isinstance(out, torch.Tensor):
        tag = guarded.get(_storage_id(out))
        return out if tag is None else _tagged_view(out, tag)
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
