"""LSE's built-in backends (cpu, jit, opencl, cuda), each registered through the ``lse.backends``
entry points like any third-party plugin; ``cgen`` is the C code generator the C-dialect devices share."""
