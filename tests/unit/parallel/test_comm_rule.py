"""Source-tree rule: only ``parallel/comm.py`` calls ``torch.distributed`` collectives.

Everything else goes through :mod:`megatron_maspo.parallel.comm`, which puts each tensor on its group's
device (a CPU tensor in an NCCL collective fails on the first GPU step). The scan follows import
aliases (``import torch.distributed as dist``, ``from torch import distributed``, ``from
torch.distributed import all_reduce``), so renaming the module does not hide a call.
"""

from __future__ import annotations

import ast
from pathlib import Path

import megatron_maspo

PACKAGE = Path(megatron_maspo.__file__).parent
COLLECTIVES = {
    "all_reduce", "broadcast", "all_gather", "all_gather_into_tensor", "reduce", "reduce_scatter",
    "reduce_scatter_tensor", "barrier", "monitored_barrier", "send", "recv", "isend", "irecv",
    "scatter", "gather", "all_to_all", "all_to_all_single", "broadcast_object_list",
    "all_gather_object", "gather_object", "scatter_object_list", "send_object_list",
    "recv_object_list", "batch_isend_irecv",
}
# Modules allowed to call collectives directly, with the reason. Keep this short.
ALLOWED = {
    "parallel/comm.py": "the communication module itself",
}


def _violations(source: str) -> list[tuple[int, str]]:
    """(line, call) of every direct collective call or import in ``source``."""
    tree = ast.parse(source)
    dist_names: set[str] = set()  # local names bound to the torch.distributed module
    torch_names: set[str] = set()  # local names bound to torch
    bad: list[tuple[int, str]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name == "torch.distributed" and a.asname:
                    dist_names.add(a.asname)
                elif a.name in ("torch", "torch.distributed"):
                    torch_names.add(a.asname or "torch")
        elif isinstance(node, ast.ImportFrom):
            if node.module == "torch":
                dist_names.update(a.asname or a.name for a in node.names if a.name == "distributed")
            elif node.module in ("torch.distributed", "torch.distributed.distributed_c10d"):
                bad += [(node.lineno, f"from {node.module} import {a.name}") for a in node.names
                        if a.name in COLLECTIVES]
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)):
            continue
        if node.func.attr not in COLLECTIVES:
            continue
        owner = node.func.value
        via_alias = isinstance(owner, ast.Name) and owner.id in dist_names
        via_torch = (isinstance(owner, ast.Attribute) and owner.attr == "distributed"
                     and isinstance(owner.value, ast.Name) and owner.value.id in torch_names)
        if via_alias or via_torch:
            bad.append((node.lineno, ast.unparse(node.func)))
    return bad


def test_scanner_finds_every_spelling():
    src = ("import torch\nimport torch.distributed as dist\nimport torch.distributed as d2\n"
           "from torch import distributed as td\nfrom torch.distributed import broadcast\n"
           "dist.all_reduce(x)\nd2.barrier()\ntd.send(x, 1)\ntorch.distributed.all_gather_object(o, x)\n"
           "dist.get_rank()\ncomm.all_reduce(x)\n")
    found = {call for _, call in _violations(src)}
    assert found == {"from torch.distributed import broadcast", "dist.all_reduce", "d2.barrier",
                     "td.send", "torch.distributed.all_gather_object"}


def test_no_collective_outside_comm():
    offenders = []
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE).as_posix()
        if rel in ALLOWED:
            continue
        offenders += [f"{rel}:{line}: {call}" for line, call in _violations(path.read_text())]
    assert not offenders, ("call collectives through megatron_maspo.parallel.comm (it stages tensors "
                           "onto the group's device):\n" + "\n".join(offenders))
    assert all((PACKAGE / rel).is_file() for rel in ALLOWED), "stale allow-list entry"
