"""What of a device's memory a plan lets the memory model's prediction fill (pure: no torch).

The memory model (``ppctl.plan.memory``) and the fake-tensor check (``ppctl check-memory``) count tensors; a GPU also
holds what no tensor does. ``MemoryBudget`` takes a fixed reserve per device for that and a share for the caching
allocator's fragmentation off the device's memory before ``ppctl plan`` fits a candidate's ranks in it. The figures
are stated, not measured here (docs/plan.md, "The memory budget").
"""

from __future__ import annotations

from dataclasses import dataclass

# The caching allocator's fragmentation: a share of the bytes a rank allocates that it cannot reuse (``MemoryBudget``).
FRAGMENTATION = 0.05


@dataclass(frozen=True)
class MemoryBudget:
    """What of a device's memory the memory model's prediction may fill: the device's bytes less ``reserve_bytes``,
    a fixed share for what no tensor holds (the CUDA context, NCCL's communicators and their buffers, cuBLAS's and
    attention's workspaces: about 2 GiB on a GPU of this class), divided by 1 + ``fragmentation`` (the allocator's
    caching and fragmentation, which grow with what a rank allocates). Neither is measured here (the fake-tensor
    check cannot see them, and no GPU was lent): docs/plan.md says where the figures come from."""

    device_bytes: float
    reserve_bytes: float
    fragmentation: float

    @property
    def usable_bytes(self) -> float:
        """The bytes a rank's predicted total may reach."""
        return (self.device_bytes - self.reserve_bytes) / (1 + self.fragmentation)

    def to_json(self) -> dict:
        """``ppctl plan --json``'s ``memory_budget``: the device's bytes, the reserve, the fragmentation and what
        the prediction may use."""
        return {"device_bytes": self.device_bytes, "reserve_bytes": self.reserve_bytes,
                "fragmentation": self.fragmentation, "usable_bytes": self.usable_bytes}
