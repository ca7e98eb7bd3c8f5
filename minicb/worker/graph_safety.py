"""What a CUDA graph cannot hold, refused on CPU: the guard of cuda_graph.py's emulation.

A CUDA graph replays recorded kernels with the shapes and addresses they had at capture. An
operation that reads a tensor's value on the host (.item(), int(), Python max()) or whose output
shape depends on values (nonzero, boolean-mask indexing) either fails the capture or freezes what it
saw then. On a GPU the capture itself tells; on CPU the emulated capture runs the step under
NoHostReads, which raises on each such operation, so that the CPU test suite catches what a real
capture would.
"""

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode


class NoToList(TorchFunctionMode):
    """Tensor.tolist() reads every value on the host without passing through the dispatcher, so
    NoHostReads sees it one level up, as a torch function."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func is torch.Tensor.tolist:
            raise RuntimeError(
                f"the captured decode step {NoHostReads.HOST_READ}: Tensor.tolist(). A CUDA "
                "graph can hold only device work with shapes fixed at capture."
            )
        return func(*args, **(kwargs or {}))


class NoHostReads(TorchDispatchMode):
    """Inside this context, refuse the operations a CUDA graph cannot hold.

    Each one needs a tensor's value on the CPU, or gives a result whose shape depends on
    values: a capture fails on it, or freezes the value it saw. Used by the CPU emulation.
    """

    refuses_host_reads = True  # what model code asks (fused_moe.capturing) to pick a static path
    HOST_READ = "reads a tensor value on the host (.item(), .tolist(), int(), bool(), max())"
    # by op name; inference mode shows `item`/`is_nonzero`, autograd mode the op below them
    FORBIDDEN = {
        "item": HOST_READ,
        "is_nonzero": HOST_READ,
        "_local_scalar_dense": HOST_READ,
        "nonzero": "has a data-dependent shape (nonzero)",
        "masked_select": "has a data-dependent shape (masked_select)",
        "_unique2": "has a data-dependent shape (unique)",
        "unique_dim": "has a data-dependent shape (unique)",
        "unique_consecutive": "has a data-dependent shape (unique_consecutive)",
        "repeat_interleave": "has a data-dependent shape (repeat_interleave)",
        "lift_fresh": "builds a tensor from Python data (torch.tensor), frozen at capture",
    }

    def __enter__(self):
        self.no_tolist = NoToList().__enter__()
        return super().__enter__()

    def __exit__(self, *exc):
        try:
            return super().__exit__(*exc)
        finally:
            self.no_tolist.__exit__(*exc)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        why = self.FORBIDDEN.get(name)
        if (
            why is None
            and name.startswith("index")
            and len(args) > 1
            and isinstance(args[1], (list, tuple))
        ):
            if any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in args[1]):
                why = "indexes with a boolean mask (data-dependent shape)"
        if why is not None:
            raise RuntimeError(
                f"the captured decode step {why}: {func}. A CUDA graph can hold only "
                "device work with shapes fixed at capture."
            )
        return func(*args, **(kwargs or {}))
