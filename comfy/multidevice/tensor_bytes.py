"""Bytes of tensors and modules, counted one way everywhere in the package.

Two questions, two functions:
- `module_bytes(module)`: the bytes of a module's state-dict tensors (its parameters and
  persistent buffers: what ComfyUI's memory accounting counts for a model too), each tensor
  once. Tied weights are one tensor object, held once on a card, so they count once; a tensor
  subclass stored as inner tensors (upstream's QuantizedTensor) counts its inner tensors. The
  logs, the per-card copies and the memory plan report this.
- `storage_bytes(module)`: the memory those tensors keep alive, each storage once. It also
  counts what a view keeps of its source (a slice of a larger tensor holds the whole storage),
  which is what the tensor-parallel shards are checked against.
"""

from __future__ import annotations

import torch


def is_flattenable(value: torch.Tensor) -> bool:
    """A tensor subclass made of inner tensors (torch's __tensor_flatten__ protocol)."""
    return hasattr(type(value), "__tensor_flatten__")


def tensor_leaves(value: torch.Tensor) -> list[torch.Tensor]:
    """The plain tensors that make up `value` (its inner tensors for a flattenable subclass)."""
    if is_flattenable(value):
        names, _ = value.__tensor_flatten__()
        return [leaf for name in names for leaf in tensor_leaves(getattr(value, name))]
    return [value.detach()]


def tensor_nbytes(value: torch.Tensor) -> int:
    """Bytes of a tensor, or of a flattenable subclass's inner tensors."""
    return sum(leaf.numel() * leaf.element_size() for leaf in tensor_leaves(value))


def module_bytes(module) -> int:
    """Bytes of the tensors `module` holds, each tensor once (see the module docstring); 0 for
    None or an object that is not a torch module."""
    if not isinstance(module, torch.nn.Module):
        return 0
    distinct = {id(t): t for t in module.state_dict(keep_vars=True).values() if t is not None}
    return sum(tensor_nbytes(t) for t in distinct.values())


def storage_bytes(module: torch.nn.Module) -> int:
    """Bytes of memory held by a module's parameters and buffers, each storage counted once.

    Counting storages, not tensor sizes, also catches a slice that keeps a whole source
    tensor alive.
    """
    storages = {(t.untyped_storage().data_ptr(), t.device): t.untyped_storage().nbytes()
                for t in (*module.parameters(), *module.buffers())}
    return sum(storages.values())
