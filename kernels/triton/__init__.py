"""Triton kernels for paged attention; every module here imports `triton`.

Nothing in this package registers a backend: `kernels.triton_paged` does, and imports these
modules only when triton is importable, so this `__init__` must stay free of triton imports
(the registry imports every package of `kernels`, triton or not).

`@triton.jit` reads `TRITON_INTERPRET` when it decorates a kernel, that is when a module here
is first imported: a process that imports them with `TRITON_INTERPRET=1` gets kernels that
run on CPU tensors through Triton's interpreter (for tests), and keeps them.
"""
