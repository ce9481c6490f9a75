"""Triton (CUDA) kernels of the reader; `forward.forward` matches `reader.reference.forward`.

Imports triton: import this package only when the triton backend is selected. Under
`TRITON_INTERPRET=1` (set before the first import) the kernels run on the CPU.
"""
