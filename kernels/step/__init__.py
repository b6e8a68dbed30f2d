"""A forward step's kernels, bound once for all of its layers.

    bind.py          ``bind_step``: the entry the model calls, once per step
    ops.py           ``StepOps``: the bound step's interface and the checks all share
    native_step.py   the C kernels, called directly
    torch_step.py    the torch references
    triton_step.py   the Triton launchers
    write_index.py   the torch path's per-step split of slots for ``write_kv``

Nothing is imported here: ``kernels.write_kv`` reads ``write_index`` while the
bound steps read ``kernels.write_kv``.
"""
