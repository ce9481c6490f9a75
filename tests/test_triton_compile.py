"""Every reader kernel compiles for Hopper (sm_90) on this CPU-only machine.

The interpreter tests run the kernels' Python, not the compiler, and the compiler is stricter
(it refuses a plain-float global that the interpreter accepts). Triton's
wheel carries LLVM and ptxas, so the whole pipeline down to a cubin runs without a GPU. The
compile runs in a subprocess because conftest sets TRITON_INTERPRET=1 for this process. Each
kernel's registers per thread and spilled stack bytes (cuobjdump, also in Triton's wheel) are
printed: they bound how many programs an SM holds, which for the one-launch kernel
(`persistent.py`) is its heaviest phase's count everywhere.
"""

import os
import subprocess
import sys

import pytest

pytest.importorskip("triton", reason="the triton extra is not installed")

SCRIPT = r"""
import os
import subprocess
import tempfile
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from neuron_moe.reader.triton import kernels as K
from neuron_moe.reader.triton.forward import SELECT_VARIANTS
from neuron_moe.reader.triton.persistent import _POINTERS, _SIZES, Tiles, persistent_kernel

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
                           blocks_per_program="i32"), [dict(SCAN=80, SC=16, BQ=32, SEM="acq_rel")], 1),
    (K.select_kernel, dict(est_ptr="*fp32", experts_ptr="*i64", weights_ptr="*bf16", norms_ptr="*bf16",
                           expert_out="*i32", channel_out="*i32", weight_out="*fp32", q_out="*fp32", ke="i32",
                           inter="i32", k="i32"),
     [dict(ACT=K.SILU, HAS_RECOVERY=False, N_P2=8192, **SELECTS[0])]
     + [dict(ACT=K.GELU_TANH, HAS_RECOVERY=True, N_P2=8192, **v) for v in SELECTS], 8),
    (K.exact_kernel, dict(gate_up_ptr="*bf16", x_ptr="*bf16", expert_ptr="*i32", channel_ptr="*i32",
                          gu_ptr="*fp32", k="i32", H="i32", inter="i32"), [dict(BK=16, BH=256, SEM="relaxed")], 4),
    (K.recover_kernel, dict(coeffs_ptr="*bf16", q_ptr="*fp32", experts_ptr="*i64", z_ptr="*fp32", ke="i32",
                            inter="i32", rank="i32", stride_e="i32", stride_i="i32", stride_r="i32"),
     [dict(RANK_P2=32, BI=64, SEM="acq_rel")], 4),
    (K.exact_recover_kernel, dict(gate_up_ptr="*bf16", x_ptr="*bf16", expert_ptr="*i32", channel_ptr="*i32",
                                  gu_ptr="*fp32", coeffs_ptr="*bf16", q_ptr="*fp32", experts_ptr="*i64",
                                  z_ptr="*fp32", T="i32", k="i32", H="i32", inter="i32", ke="i32", rank="i32",
                                  stride_e="i32", stride_i="i32", stride_r="i32"),
     [dict(BK=16, BH=256, RANK_P2=32, BI=64, SEM="acq_rel")], 4),
    (K.down_kernel, dict(down_ptr="*bf16", expert_ptr="*i32", channel_ptr="*i32", weight_ptr="*fp32",
                         gu_ptr="*fp32", basis_ptr="*bf16", z_ptr="*fp32", out_ptr="*fp32", k="i32", H="i32",
                         inter="i32", rank="i32", stride_h="i32", stride_r="i32", rows_per_share="i32"),
     [dict(ACT=a, HAS_RECOVERY=r, RANK_P2=32, BK=16, BH=128, SEM="acq_rel")
      for a, r in ((K.GELU_TANH, True), (K.SILU, False))], 4),
]
# the one-launch kernel: its default tiles (Gemma-4: 8192 channels in 8 chunks), and SiLU without recovery
# with the nanosleep backoff and a register cap (the shapes its variants add)
PERSISTENT = dict(zip([p + "_ptr" for p in _POINTERS],
                      "*bf16 *i8 *fp32 *u8 *bf16 *i64 *bf16 *bf16 *bf16 *bf16 *bf16 *bf16 *fp32 *i32 *fp32 *fp32 *i32 "
                      "*i32 *fp32 *i32 *i32 *i32 *fp32 *fp32 *fp32 *fp32 *fp32 *bf16".split()))
PERSISTENT |= {"ctr_ptr": "*i32", **dict.fromkeys(_SIZES, "i32")}
for act, recovery, tiles in ((K.GELU_TANH, True, Tiles()), (K.SILU, False, Tiles(spin_ns=256, maxnreg=128))):
    const = dict(ACT=act, HAS_RECOVERY=recovery, N_P2=8192, CHUNKS=8192 // tiles.chunk, SCAN=80, BLOCK=128, SC=tiles.sc,
                 BQ=tiles.bq, BK=tiles.bk, EXACT_BH=tiles.exact_bh, BH=tiles.bh, BI=tiles.bi, RANK_P2=32, ZB=1024,
                 SEM=tiles.atomics, LIMIT=1 << 22, SPIN_NS=tiles.spin_ns)
    CASES.append((persistent_kernel, PERSISTENT, [const], tiles.warps, tiles.maxnreg))
cuobjdump = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
target = GPUTarget("cuda", 90, 32)
for fn, sig, variants, warps, *maxnreg in CASES:  # warps: as forward.py launches it
    for const in variants:
        src = ASTSource(fn, {**sig, **{k: "constexpr" for k in const}}, constexprs=const)
        options = {"num_warps": warps, **({"maxnreg": maxnreg[0]} if maxnreg and maxnreg[0] else {})}
        compiled = triton.compile(src, target=target, options=options)
        assert compiled.asm["cubin"], fn.__name__
        with tempfile.NamedTemporaryFile("wb", suffix=".cubin") as f:
            f.write(compiled.asm["cubin"])
            f.flush()
            usage = subprocess.run([cuobjdump, "--dump-resource-usage", f.name], capture_output=True, text=True).stdout
        regs = [word for line in usage.splitlines() for word in line.split() if word.startswith(("REG:", "STACK:"))]
        print(fn.__name__, {k: v for k, v in const.items() if k in ("ACT", "SEARCH", "PLACE", "HAS_RECOVERY",
                                                                    "SPIN_NS")},
              f"{warps} warps", *regs, "sm_90 cubin", len(compiled.asm["cubin"]), "bytes")
"""


@pytest.mark.slow
def test_every_kernel_compiles_for_sm90():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_DEFAULT_FP_FUSION"] = "1"
    proc = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert proc.stdout.count("sm_90 cubin") == 9 + 5 + 2, proc.stdout  # 5: select's variants beside its default
    # the one-launch kernel at its default tiles spills nothing (its phases are sliced to stay light)
    default = next(line for line in proc.stdout.splitlines() if line.startswith("persistent_kernel"))
    assert "STACK:0" in default.split(), default
    print(proc.stdout)
