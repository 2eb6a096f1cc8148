"""Described clusters: what planning and simulation know about the hardware.

Planning code never touches Ray: it reads a :class:`ClusterSpec`, which a live
cluster (``meshshard.init``) reports about itself, or which a user writes down (or
takes from a preset) to plan for a cluster they are not sitting at.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass(frozen=True)
class ClusterSpec:
    """A cluster of ``num_hosts`` identical hosts with ``devices_per_host`` devices each.

    Args:
        name: a label shown in plans (``"local-4x2"``, ``"dgx-a100"``).
        num_hosts: number of hosts (one host-actor each at run time).
        devices_per_host: accelerator (or emulated CPU) devices per host.
    """

    name: str = "local"
    num_hosts: int = 4
    devices_per_host: int = 2

    def __post_init__(self) -> None:
        for field_name in ("num_hosts", "devices_per_host"):
            value = getattr(self, field_name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(
                    f"ClusterSpec.{field_name} must be a positive int, got {value!r}; "
                    f"pass e.g. ClusterSpec({field_name}=2)"
                )

    @property
    def num_devices(self) -> int:
        """Total devices in the cluster."""
        return self.num_hosts * self.devices_per_host

    def __str__(self) -> str:
        return f"{self.name} ({self.num_hosts} hosts x {self.devices_per_host} devices)"

    def to_dict(self) -> dict:
        """A JSON-ready dict; :meth:`from_dict` reads it back."""
        return asdict(self)

    @staticmethod
    def from_dict(d: dict) -> ClusterSpec:
        """Inverse of :meth:`to_dict`."""
        return ClusterSpec(**d)
