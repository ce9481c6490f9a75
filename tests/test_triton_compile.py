"""Every reader kernel compiles for Hopper (sm_90) on this CPU-only machine.

The interpreter tests run the kernels' Python, not the compiler, and the compiler is stricter
(the first H200 run failed on a plain-float global the interpreter had accepted). Triton's
wheel carries LLVM and ptxas, so the whole pipeline down to a cubin runs without a GPU. The
compile runs in a subprocess because conftest sets TRITON_INTERPRET=1 for this process.
"""

import os
import subprocess
import sys

import pytest

pytest.importorskip("triton", reason="the triton extra is not installed")

SCRIPT = r"""
import itertools
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from neuron_moe.reader.triton import kernels as K
from neuron_moe.reader.triton.forward import SELECT_VARIANTS

# select_kernel's variants (search, digit width, placement; the first its default) as constexprs:
# ASTSource does not apply a kernel's defaults
SELECTS = [dict(SEARCH=v.get("search", K.BISECT), RADIX_BITS=v.get("radix_bits", 8), PLACE=v.get("place", K.TWO_SCANS))
           for v in SELECT_VARIANTS.values()]

P = {"bf16": "*bf16", "f32": "*fp32", "i32": "*i32", "u8": "*u8"}
CASES = [
    (K.rotate_scan_kernel, dict(x_ptr="*bf16", signs_ptr="*i8", hadamard_ptr="*fp32", coords_ptr="*i32",
                                values_ptr="*fp32", zero_ptr="*fp32", H="i32", nb="i32", zero_n="i32",
                                zero_per_program="i32"), [dict(SCAN=80, BLOCK=128, ZB=1024)], 4),
    (K.screen_kernel, dict(codes_ptr="*u8", scales_ptr="*bf16", experts_ptr="*i64", coords_ptr="*i32",
                           values_ptr="*fp32", out_ptr="*fp32", ke="i32", nb="i32", strip="i32", rows="i32",
                           blocks_per_program="i32"), [dict(SCAN=80, SC=16, BQ=32)], 1),
    (K.select_kernel, dict(est_ptr="*fp32", experts_ptr="*i64", weights_ptr="*bf16", norms_ptr="*bf16",
                           expert_out="*i32", channel_out="*i32", weight_out="*fp32", q_out="*fp32", ke="i32",
                           inter="i32", k="i32"),
     [dict(ACT=K.SILU, HAS_RECOVERY=False, N_P2=8192, **SELECTS[0])]
     + [dict(ACT=K.GELU_TANH, HAS_RECOVERY=True, N_P2=8192, **v) for v in SELECTS], 8),
    (K.exact_kernel, dict(gate_up_ptr="*bf16", x_ptr="*bf16", expert_ptr="*i32", channel_ptr="*i32",
                          gu_ptr="*fp32", k="i32", H="i32", inter="i32"), [dict(BK=16, BH=256)], 4),
    (K.recover_kernel, dict(coeffs_ptr="*bf16", q_ptr="*fp32", experts_ptr="*i64", z_ptr="*fp32", ke="i32",
                            inter="i32", rank="i32", stride_e="i32", stride_i="i32", stride_r="i32"),
     [dict(RANK_P2=32, BI=64)], 4),
    (K.exact_recover_kernel, dict(gate_up_ptr="*bf16", x_ptr="*bf16", expert_ptr="*i32", channel_ptr="*i32",
                                  gu_ptr="*fp32", coeffs_ptr="*bf16", q_ptr="*fp32", experts_ptr="*i64",
                                  z_ptr="*fp32", T="i32", k="i32", H="i32", inter="i32", ke="i32", rank="i32",
                                  stride_e="i32", stride_i="i32", stride_r="i32"),
     [dict(BK=16, BH=256, RANK_P2=32, BI=64)], 4),
    (K.down_kernel, dict(down_ptr="*bf16", expert_ptr="*i32", channel_ptr="*i32", weight_ptr="*fp32",
                         gu_ptr="*fp32", basis_ptr="*bf16", z_ptr="*fp32", out_ptr="*fp32", k="i32", H="i32",
                         inter="i32", rank="i32", stride_h="i32", stride_r="i32", rows_per_share="i32"),
     [dict(ACT=a, HAS_RECOVERY=r, RANK_P2=32, BK=16, BH=128) for a, r in ((K.GELU_TANH, True), (K.SILU, False))], 4),
]
target = GPUTarget("cuda", 90, 32)
for fn, sig, variants, warps in CASES:  # warps: as forward.py launches it
    for const in variants:
        src = ASTSource(fn, {**sig, **{k: "constexpr" for k in const}}, constexprs=const)
        compiled = triton.compile(src, target=target, options={"num_warps": warps})
        assert compiled.asm["cubin"], fn.__name__
        print(fn.__name__, const, "sm_90 cubin", len(compiled.asm["cubin"]), "bytes")
"""


def test_every_kernel_compiles_for_sm90():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_DEFAULT_FP_FUSION"] = "1"
    proc = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert proc.stdout.count("sm_90 cubin") == 9 + 5, proc.stdout  # 5: select's variants beside its default
