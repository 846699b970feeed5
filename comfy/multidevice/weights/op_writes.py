"""Which tensors an ATen op call writes: the arguments its schema marks (a!), and those some kernels write unmarked."""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import torch


def leaves(value: Any):
    """Every item of nested lists, tuples and dict values (an op's arguments), depth first."""
    if isinstance(value, (list, tuple)):
        for v in value:
            yield from leaves(v)
    elif isinstance(value, dict):
        for v in value.values():
            yield from leaves(v)
    else:
        yield value


# ATen ops whose kernels write arguments that their schema does not mark as written (a!), so the
# schema check alone lets them through: op -> (the arguments written, the bool argument that must
# be true for the write, None when the op always writes). Found by a search over every schema
# (torch._C._jit_get_all_schemas()) for Tensor arguments without alias info named like state
# (running_*, *_state, noise, scale, found_inf, ...) and in-place names (..._) that mark nothing;
# each candidate checked (CPU ones run on a plain tensor, card-only ones from their kernels); the test
# test_every_unmarked_running_stats_op_is_listed repeats the running_mean / running_var part.
# batch_norm, _batch_norm_impl_index, instance_norm and _no_grad_embedding_renorm_ are composite
# (they reach us as the ops they call, already checked) and are listed for when they do not.
_RUNNING_STATS = ("running_mean", "running_var")
UNMARKED_WRITES = {
    "aten::native_batch_norm": (_RUNNING_STATS, "training"),
    "aten::cudnn_batch_norm": (_RUNNING_STATS, "training"),
    "aten::miopen_batch_norm": (_RUNNING_STATS, "training"),
    "aten::batch_norm": (_RUNNING_STATS, "training"),
    "aten::_batch_norm_impl_index": (_RUNNING_STATS, "training"),
    "aten::instance_norm": (_RUNNING_STATS, "use_input_stats"),
    "aten::batch_norm_update_stats": (_RUNNING_STATS, None),
    "aten::batch_norm_gather_stats": (_RUNNING_STATS, None),
    "aten::batch_norm_gather_stats_with_counts": (_RUNNING_STATS, None),
    "aten::_no_grad_embedding_renorm_": (("weight",), None),
}


class _Written(NamedTuple):
    """An argument an op writes: where it is, and the bool argument that must be true for it."""
    position: int
    name: str
    kwarg_only: bool
    when: "_Written | None" = None  # (the condition is read with the same lookup)


@functools.lru_cache(maxsize=None)
def _written_arguments(op) -> tuple[_Written, ...]:
    """Every argument the op writes: those its schema marks (a!), and UNMARKED_WRITES."""
    schema = getattr(op, "_schema", None)
    if schema is None:
        return ()
    arguments = {a.name: _Written(i, a.name, a.kwarg_only) for i, a in enumerate(schema.arguments)}
    written = [arguments[a.name] for a in schema.arguments
               if a.alias_info is not None and a.alias_info.is_write]
    names, condition = UNMARKED_WRITES.get(schema.name, ((), None))
    when = arguments.get(condition)
    written += [arguments[n]._replace(when=when) for n in names if n in arguments]
    return tuple(written)


def _argument(argument: _Written, args, kwargs):
    if argument.kwarg_only or argument.position >= len(args):
        return kwargs.get(argument.name)
    return args[argument.position]


def written_tensors(func, args, kwargs):
    """(argument name, tensor) of every tensor the call func(*args, **kwargs) writes, argument by
    argument; an argument written only under a condition (batch norm's `training`) when it holds."""
    for written in _written_arguments(func):
        if written.when is not None and not _argument(written.when, args, kwargs):
            continue  # e.g. batch norm in inference: the running stats are only read
        for t in leaves(_argument(written, args, kwargs)):
            if isinstance(t, torch.Tensor):
                yield written.name, t
