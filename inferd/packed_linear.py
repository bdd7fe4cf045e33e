"""Linear layers whose weights are laid out once for oneDNN's CPU matmul, not on every call.

`F.linear` on the CPU hands fp32 weights to MKL's sgemm, which repacks the
weight matrix into its kernel's layout on every call. At decode batch sizes
that copy costs more than the multiply: in a served 16-sequence decode step of
the bench model (4 layers, hidden 256), MKL's packing routine took 30% of the
forward thread and its kernel 22%. oneDNN can take the weight already in its
blocked layout (`mkldnn._reorder_linear_weight`) and skip the copy. Measured on
2 cores, the four matmuls of one layer took 325 us instead of 613 at 16 rows,
279 instead of 384 at 1 row and 6.2 ms instead of 7.2 at 512; a weight laid out
for 16 rows is as fast as one laid out for the pass's own row count at every
size, so one layout serves decode, prefill and mixes alike.

fp32 results differ from MKL's in the last bits (a different summation
order; 4e-6 relative), as any other matmul kernel's would; bfloat16 results
are bit for bit the same, since torch already sends bf16 matmuls to oneDNN.
Where the layout is not offered (a torch build without oneDNN, fp16 on a CPU
without its instructions, a GPU tensor) the weight stays as it was and
`linear` is `F.linear`.
"""

from __future__ import annotations

import warnings

import structlog
import torch
import torch.nn.functional as F

__all__ = ["LAYOUT_ROWS", "linear", "packed"]

log = structlog.get_logger("inferd.packed_linear")

# As inferd.layer_stack says of torch.jit.trace: torch.compile and torch.export do not yet give a graph that runs
# without the GIL on the CPU, and the one scripted function here is part of such a graph.
warnings.filterwarnings("ignore", message=r"`torch\.jit\.script` is deprecated", category=DeprecationWarning)

LAYOUT_ROWS = 16        # the row count oneDNN lays weights out for (see the docstring)
PACKED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)

_matmul: torch.jit.ScriptFunction | None = None


def _script() -> torch.jit.ScriptFunction:
    """The oneDNN call, scripted: torch.jit.trace cannot record its empty list of optional scalars,
    a scripted function can, and a traced graph runs it inline like any other op."""
    global _matmul
    if _matmul is None:
        def packed_matmul(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
            no_scalars = torch.jit.annotate(list[int | float | complex | None], [])
            return torch.ops.mkldnn._linear_pointwise(x, w, b, "none", no_scalars, "")
        _matmul = torch.jit.script(packed_matmul)
    return _matmul


def packed(weight: torch.Tensor) -> torch.Tensor:
    """`weight` ([out, in]) in oneDNN's layout where this torch and CPU offer it; else `weight` itself."""
    if weight.device.type != "cpu" or weight.dtype not in PACKED_DTYPES or not torch.backends.mkldnn.is_available():
        return weight
    try:
        laid_out = torch.ops.mkldnn._reorder_linear_weight(weight, LAYOUT_ROWS)
        probe = torch.zeros(1, weight.shape[1], dtype=weight.dtype)
        _script()(probe, laid_out, None)                        # the op runs here, or nowhere
    except (RuntimeError, AttributeError) as exc:               # fp16 without avx512_fp16; no such op
        log.debug("linear weight kept in its own layout", dtype=str(weight.dtype), error=str(exc))
        return weight
    return laid_out


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """`F.linear`, through oneDNN when `weight` came from `packed` (decided once per weight when traced)."""
    if weight.is_mkldnn:
        return _script()(x, weight, bias)
    return F.linear(x, weight, bias)
