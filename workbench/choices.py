"""The engine's choice lists and tree-capacity rule, declared once: the settings registry (workbench.settings) and the
engine modules (graphs, kv_cache, kv_quant, quant, drafters) import them from here.

Torch-free and import-free (the dashboard and studies import it through workbench.settings in light processes).

    >>> tree_capacity(4, 4), tree_capacity(5, 1)
    (52, 5)
"""
from __future__ import annotations

AUTO = "auto"  # a knob value resolved per device before a run (workbench.settings.resolve_auto)

DTYPES = ("float32", "bfloat16", "float16")                       # model dtypes the engine loads weights in
HALF_DTYPES = ("bfloat16", "float16")                             # a model's own dtype that `auto` keeps on a GPU
COMPILE_MODES = ("off", "default", "max-autotune")                # torch.compile modes of the fixed-shape steps
ATTENTION_BACKENDS = ("auto", "sdpa", "triton")                   # engine/kv_cache.py resolves "auto" per device
KV_FORMATS = ("none", "int8", "fp8")                              # KV-cache formats (engine/kv_quant.py)
WEIGHT_FORMATS = ("none", "int8", "int4", "int4-awq", "fp8", "gguf")  # weight formats (engine/quant)
QUANT_KERNELS = ("auto", "aten", "dequant", "triton")             # matmul kernels of the decoder linears
INT4_GROUP_SIZES = (32, 64, 128, 256)
GEMV_FUSIONS = ("off", "residual", "glu+residual", "glu+residual+ores", "norm+glu+residual")
# the Triton verify kernel takes tree masks up to T = 64 (root + nodes)
MAX_TREE_NODES = 63


def tree_capacity(depth: int, topk: int) -> int:
    """Candidates an EAGLE dynamic tree offers (K at depth 1, K^2 at each further depth): tree_budget's upper bound."""
    return topk + (depth - 1) * topk * topk
