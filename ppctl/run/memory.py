"""Measured memory: the bytes an object holds and the peak bytes a step allocates on top.

Two measurements, the same on CPU and CUDA:

- ``held_bytes(root)``: the distinct storages of every tensor reachable from ``root``
  through attributes, containers and modules (parameters, gradients and their flat
  buffers, optimizer state, receive buffers): what a training loop keeps between steps.
- ``StoragePeak``: while active, a ``TorchDispatchMode`` sees the output of every
  operation, counts each new storage once and subtracts it when the storage is freed,
  giving the most bytes the operations held at once (saved activations, messages,
  gradients in flight). Scratch space inside a fused kernel is not an operation output
  and is not seen; on CUDA ``step_peak_bytes`` reads the allocator's own peak instead.
"""

from __future__ import annotations

import weakref
from typing import Callable

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves


class StoragePeak(TorchDispatchMode):
    """Running total and peak of the bytes of storages created by operations while the mode is active.

    Storages of ``existing`` tensors are never counted, even when an operation returns a view of them.
    """

    def __init__(self, existing: list[torch.Tensor] = ()):
        super().__init__()
        self.counted = {storage_key(tensor.untyped_storage()) for tensor in existing}
        self.live_bytes = 0
        self.peak_bytes = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        result = func(*args, **(kwargs or {}))
        self.count_outputs(result)
        return result

    def count_outputs(self, result) -> None:
        """Count the storages of the tensors an operation returned (``result``) that are not counted yet."""
        for leaf in tree_leaves(result):
            if isinstance(leaf, torch.Tensor):
                self._count(leaf.untyped_storage())

    def left_out(self, key: int) -> bool:
        """Whether the storage of ``key`` is never counted (a subclass's choice; none here)."""
        return False

    def _count(self, storage) -> None:
        key, size = storage_key(storage), storage.nbytes()
        if size == 0 or key in self.counted or self.left_out(key):
            return
        self.counted.add(key)
        self.live_bytes += size
        self.peak_bytes = max(self.peak_bytes, self.live_bytes)
        weakref.finalize(storage, self._release, key, size)

    def _release(self, key: int, size: int) -> None:
        if key in self.counted:  # a count started over (``counted`` replaced) forgets the storages before it
            self.counted.discard(key)
            self.live_bytes -= size


def storage_key(storage) -> int:
    """What tells a storage apart from every other one alive: its storage object (a fake tensor's storage has no
    address: every one reads 0), shared by the tensors viewing it."""
    return storage._cdata


def storage_bytes(tensors) -> int:
    """Bytes of the distinct storages of ``tensors`` (None left out; views of one storage count it once)."""
    return sum({storage_key(tensor.untyped_storage()): tensor.untyped_storage().nbytes()
                for tensor in tensors if tensor is not None}.values())


def reachable_tensors(root) -> list[torch.Tensor]:
    """Every tensor reachable from ``root`` through object attributes, dicts, lists, tuples and sets.

    Only ppctl's and torch's own objects are entered (not functions, data sets or arrays); each object once.
    """
    found, seen, pending = [], set(), [root]
    while pending:
        item = pending.pop()
        if id(item) in seen or item is None or isinstance(item, (str, bytes, int, float, bool, type)):
            continue
        seen.add(id(item))
        if isinstance(item, torch.Tensor):
            found.append(item)
            grad = item.grad if item.is_leaf else None
            pending += [grad, getattr(item, "main_grad", None)]
        elif isinstance(item, dict):
            pending += list(item.keys()) + list(item.values())
        elif isinstance(item, (list, tuple, set, frozenset)):
            pending += list(item)
        elif _walked_into(item):
            pending += list(vars(item).values()) if hasattr(item, "__dict__") else [
                getattr(item, name, None) for name in getattr(type(item), "__slots__", ())]
    return found


def _walked_into(item) -> bool:
    """Objects of ppctl and torch (modules, optimizers, pipeline stages and schedules) are entered; data sets,
    arrays, functions and anything else are not."""
    package = type(item).__module__.split(".")[0]
    return package in ("ppctl", "torch") and not callable(item) or isinstance(item, torch.nn.Module)


def held_bytes(root) -> int:
    """Bytes of the distinct storages of the tensors reachable from ``root`` (``reachable_tensors``)."""
    storages = {}
    for tensor in reachable_tensors(root):
        storage = tensor.untyped_storage()
        storages[storage_key(storage)] = storage.nbytes()
    return sum(storages.values())


def step_peak_bytes(run_step: Callable[[], object], holder, device: str) -> int:
    """The peak bytes of one call of ``run_step``: what ``holder`` holds before it plus the most the step's
    operations allocated on top (CUDA: the allocator's peak over its bytes before the step)."""
    held = held_bytes(holder)
    if device.startswith("cuda"):
        torch.cuda.synchronize(device)
        before = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        run_step()
        torch.cuda.synchronize(device)
        return held + torch.cuda.max_memory_allocated(device) - before
    with StoragePeak(reachable_tensors(holder)) as tracker:
        run_step()
    return held + tracker.peak_bytes
