"""No pickle on the wire: the code that handles what other processes send (workers/ and the
torch.distributed communicator) never unpickles, never uses a *_object collective (they
unpickle every rank's bytes), never calls torch.load without weights_only=True, marshal, eval
or exec. Read with ast, so a comment or a docstring that names them does not count."""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
NETWORK_CODE = [*sorted((REPO / "comfy" / "multidevice" / "workers").glob("*.py")),
                REPO / "comfy" / "multidevice" / "comm" / "torch_dist.py",
                REPO / "comfy" / "multidevice" / "comm" / "torch_dist_transfers.py"]
UNPICKLERS = {"pickle", "_pickle", "cPickle", "cloudpickle", "dill", "marshal", "shelve", "copyreg"}
OBJECT_COLLECTIVES = {"all_gather_object", "broadcast_object_list", "gather_object", "scatter_object_list",
                      "send_object_list", "recv_object_list"}
CODE_RUNNERS = {"eval", "exec"}


def _is_torch_load(func: ast.expr) -> bool:
    return isinstance(func, ast.Attribute) and func.attr == "load" and isinstance(func.value, ast.Name) \
        and func.value.id == "torch"


def _weights_only(call: ast.Call) -> bool:
    return any(k.arg == "weights_only" and isinstance(k.value, ast.Constant) and k.value.value is True
               for k in call.keywords)


def findings(source: str, name: str = "<source>") -> list[str]:
    """`name:line: what` for every forbidden use in `source`."""
    found = []
    for node in ast.walk(ast.parse(source)):
        line = f"{name}:{getattr(node, 'lineno', '?')}"
        if isinstance(node, ast.Import):
            found += [f"{line}: import {a.name}" for a in node.names if a.name.split(".")[0] in UNPICKLERS]
        elif isinstance(node, ast.ImportFrom):
            if (node.module or "").split(".")[0] in UNPICKLERS:
                found.append(f"{line}: from {node.module} import ...")
            found += [f"{line}: imports {a.name}" for a in node.names if a.name in OBJECT_COLLECTIVES | CODE_RUNNERS]
        elif isinstance(node, ast.Attribute):
            if isinstance(node.value, ast.Name) and node.value.id in UNPICKLERS:
                found.append(f"{line}: {node.value.id}.{node.attr}")
            if node.attr in OBJECT_COLLECTIVES:
                found.append(f"{line}: {node.attr} (an *_object collective unpickles)")
        elif isinstance(node, ast.Name) and node.id in OBJECT_COLLECTIVES:
            found.append(f"{line}: {node.id} (an *_object collective unpickles)")
        elif isinstance(node, ast.Call):
            if isinstance(node.func, ast.Name) and node.func.id in CODE_RUNNERS:
                found.append(f"{line}: {node.func.id}(...)")
            if _is_torch_load(node.func) and not _weights_only(node):
                found.append(f"{line}: torch.load without weights_only=True")
    return found


def test_the_finder_finds_each_forbidden_use_and_not_comments():
    source = '''
"""pickle.loads in a docstring, eval( in prose"""
import pickle  # pickle.loads in a comment
import marshal
from pickle import loads
import torch.distributed as dist
x = pickle.loads(b"")
dist.all_gather_object([], 1)
from torch.distributed import broadcast_object_list
torch.load("f")
torch.load("f", weights_only=True)
eval("1")
exec("x = 1")
'''
    assert sorted(f.split(": ", 1)[1] for f in findings(source)) == sorted([
        "import pickle", "import marshal", "from pickle import ...", "pickle.loads",
        "all_gather_object (an *_object collective unpickles)", "imports broadcast_object_list",
        "torch.load without weights_only=True", "eval(...)", "exec(...)"])


def test_no_pickle_object_collective_or_code_runner_in_the_network_code():
    assert len(NETWORK_CODE) > 10 and all(p.is_file() for p in NETWORK_CODE)
    found = [f for path in NETWORK_CODE
             for f in findings(path.read_text(encoding="utf-8"), path.relative_to(REPO).as_posix())]
    assert not found, "data from other processes must be wire data (workers/wire.py), never code:\n" + "\n".join(found)
