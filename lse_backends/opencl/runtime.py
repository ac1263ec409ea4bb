"""The OpenCL runtime pieces, tinygrad style: a compiler (program builds cached per source and
options), a program wrapper that keeps its kernel objects, and an allocator of device tensors."""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import pyopencl as cl
import pyopencl.tools


@dataclass
class CLTensor:
    """A device buffer and the array it holds."""

    buf: cl.MemoryObjectHolder
    shape: tuple[int, ...]
    dtype: np.dtype


SCALAR_TYPES = {"int": np.int32, "uint": np.uint32, "float": np.float32}


class CLProgram:
    """A built program; ``kernel(name)`` returns the same kernel object each time (pyopencl's
    ``prg.name`` creates a new one per access). Kernels take plain Python ints and floats for
    their scalar arguments: typed once here, setting them costs a few microseconds instead of
    tens for numpy scalars."""

    def __init__(self, program: cl.Program) -> None:
        self.program = program
        self._kernels: dict[str, cl.Kernel] = {}

    def kernel(self, name: str) -> cl.Kernel:
        if name not in self._kernels:
            kernel = cl.Kernel(self.program, name)
            types = [kernel.get_arg_info(i, cl.kernel_arg_info.TYPE_NAME) for i in range(kernel.num_args)]
            kernel.set_scalar_arg_dtypes([SCALAR_TYPES.get(t) for t in types])
            self._kernels[name] = kernel
        return self._kernels[name]


class CLCompiler:
    def __init__(self, context: cl.Context) -> None:
        self.context = context
        self._programs: dict[tuple[str, str], CLProgram] = {}

    def build(self, source: str, options: str = "") -> CLProgram:
        key = (source, options)
        if key not in self._programs:
            program = cl.Program(self.context, source).build(options=["-cl-kernel-arg-info", *options.split()])
            self._programs[key] = CLProgram(program)
        return self._programs[key]


class CLAllocator:
    """Tensors from a memory pool: a buffer returns to the pool when its tensor is dropped, and the
    in-order queue keeps a reused buffer from being overwritten before earlier kernels read it."""

    def __init__(self, queue: cl.CommandQueue) -> None:
        self.queue = queue
        self._pool = pyopencl.tools.MemoryPool(pyopencl.tools.ImmediateAllocator(queue))

    def empty(self, shape: tuple[int, ...], dtype: type = np.float32) -> CLTensor:
        dt = np.dtype(dtype)
        nbytes = math.prod(shape) * dt.itemsize
        return CLTensor(self._pool.allocate(max(nbytes, dt.itemsize)), tuple(shape), dt)

    def to_device(self, array: np.ndarray) -> CLTensor:
        host = np.ascontiguousarray(array)
        tensor = self.empty(host.shape, host.dtype)
        if host.nbytes:
            cl.enqueue_copy(self.queue, tensor.buf, host)
        return tensor

    def upload(self, array: np.ndarray) -> CLTensor:
        """A long-lived tensor (a weight, a KV cache) outside the pool."""
        host = np.ascontiguousarray(array)
        buf = cl.Buffer(self.queue.context, cl.mem_flags.READ_WRITE, max(host.nbytes, host.itemsize))
        if host.nbytes:
            cl.enqueue_copy(self.queue, buf, host)
        return CLTensor(buf, host.shape, host.dtype)

    def upload_packed(self, arrays: dict[str, np.ndarray]) -> dict[str, CLTensor]:
        """Several small arrays in one buffer, copied at its creation (no queued command), each
        a sub-buffer at an offset the device accepts."""
        align = max(self.queue.device.mem_base_addr_align // 8, 4)
        offsets, total = {}, 0
        for name, a in arrays.items():
            offsets[name] = total
            total += -(-max(a.nbytes, 1) // align) * align
        host = np.zeros(total, np.uint8)
        for name, a in arrays.items():
            host[offsets[name]:offsets[name] + a.nbytes] = np.ascontiguousarray(a).view(np.uint8).reshape(-1)
        flags = cl.mem_flags.READ_ONLY | cl.mem_flags.COPY_HOST_PTR
        buf = cl.Buffer(self.queue.context, flags, hostbuf=host)
        return {name: CLTensor(buf.get_sub_region(offsets[name], max(a.nbytes, 1)), a.shape, a.dtype)
                for name, a in arrays.items()}

    def to_host(self, tensor: CLTensor) -> np.ndarray:
        host = np.empty(tensor.shape, tensor.dtype)
        if host.nbytes:
            cl.enqueue_copy(self.queue, host, tensor.buf)
        return host

    def free_pool(self) -> None:
        self._pool.free_held()
