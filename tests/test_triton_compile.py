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

P = {"bf16": "*bf16", "f32": "*fp32", "i32": "*i32", "u8": "*u8"}
CASES = [
    (K.screen_kernel, dict(codes_ptr="*u8", scales_ptr="*bf16", experts_ptr="*i32", coords_ptr="*i32",
                           values_ptr="*fp32", out_ptr="*fp32", ke="i32", nb="i32", scan="i32", strip="i32",
                           rows="i32"), [dict(SCAN_P2=128, BQ=32)]),
    (K.exact_act_kernel, dict(gate_up_ptr="*bf16", x_ptr="*fp32", expert_ptr="*i32", channel_ptr="*i32",
                              weight_ptr="*fp32", coef_ptr="*fp32", k="i32", H="i32", inter="i32"),
     [dict(ACT=a, BK=16, BH=128) for a in (K.GELU_TANH, K.SILU)]),
    (K.recover_kernel, dict(coeffs_ptr="*bf16", q_ptr="*fp32", z_ptr="*fp32", inter="i32", rank="i32",
                            stride_e="i32", stride_i="i32", stride_r="i32", experts_ptr="*i32"),
     [dict(RANK_P2=32, BI=64)]),
    (K.down_kernel, dict(down_ptr="*bf16", expert_ptr="*i32", channel_ptr="*i32", coef_ptr="*fp32",
                         basis_ptr="*bf16", z_ptr="*fp32", out_ptr="*fp32", k="i32", H="i32", inter="i32",
                         ke="i32", rank="i32", stride_h="i32", stride_r="i32"),
     [dict(HAS_RECOVERY=r, RANK_P2=32, BK=16, BH=128) for r in (True, False)]),
]
target = GPUTarget("cuda", 90, 32)
for fn, sig, variants in CASES:
    for const in variants:
        src = ASTSource(fn, {**sig, **{k: "constexpr" for k in const}}, constexprs=const)
        compiled = triton.compile(src, target=target)
        assert compiled.asm["cubin"], fn.__name__
        print(fn.__name__, const, "sm_90 cubin", len(compiled.asm["cubin"]), "bytes")
"""


def test_every_kernel_compiles_for_sm90():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_DEFAULT_FP_FUSION"] = "1"
    proc = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert proc.stdout.count("sm_90 cubin") == 6, proc.stdout
