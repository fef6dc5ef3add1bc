"""tensordict's TensorDict, imported without loading torch.compile's tracer.

tensordict calls two `torch.compiler` helpers while it imports (`allow_in_graph` on functorch's
C++ functions, `assume_constant_result` on a lock check); each imports `torch._dynamo`, which
pulls in sympy: about 3.5 s of every process's start on a 2-core machine (the driver's and
each Ray worker's), for marks that matter only to `torch.compile` tracing through tensordict's
own code, which tephra never compiles. Importing it here with the two helpers as identities
skips that; without the marks, a compiled region calling those functions would split its graph
there, not compute anything differently. Everything in tephra imports TensorDict from here
(ruff's banned-api rule holds the line).
"""

from __future__ import annotations

import sys

import torch.compiler

if "tensordict" not in sys.modules:
    _marks = (torch.compiler.allow_in_graph, torch.compiler.assume_constant_result)
    torch.compiler.allow_in_graph = lambda fn: fn
    torch.compiler.assume_constant_result = lambda fn: fn
    try:
        import tensordict  # noqa: F401, TID251  (the import is the point: its marks skipped)
    finally:
        torch.compiler.allow_in_graph, torch.compiler.assume_constant_result = _marks

from tensordict import NonTensorData, NonTensorStack, TensorDict  # noqa: E402, TID251

__all__ = ["NonTensorData", "NonTensorStack", "TensorDict"]
