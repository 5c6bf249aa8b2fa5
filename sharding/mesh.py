"""`MeshConfig`: the device mesh as a small frozen config, `data` x `model`.

- `data` splits the batch (cache slots) across devices: each group holds whole rows.
- `model` splits each weight matrix (attention heads, MLP units, vocabulary): tensor parallel.

Sizes are given or inferred. `-1` means "the rest of the devices" (at most one axis). An axis
left unset (None) is 1 when another axis is -1; otherwise the first unset axis takes the rest.
So on 8 devices: `MeshConfig()` is (8, 1), `MeshConfig(model=4)` is (2, 4),
`MeshConfig(data=1)` is (1, 8), `MeshConfig(data=2, model=2)` uses the first 4 devices.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Sequence

import jax
from jax.sharding import AxisType, Mesh

AXES = ("data", "model")


@dataclasses.dataclass(frozen=True)
class MeshConfig:
  """Mesh axis sizes; see the module docstring for how unset and -1 sizes are resolved."""

  data: int | None = None
  model: int | None = None

  def __post_init__(self):
    sizes = self.given()
    for name, size in sizes.items():
      if not isinstance(size, int) or isinstance(size, bool) or (size < 1 and size != -1):
        raise ValueError(f"mesh axis {name}={size!r}: a size must be a positive int or -1 (the rest of the devices)")
    rest = [name for name, size in sizes.items() if size == -1]
    if len(rest) > 1:
      raise ValueError(f"mesh axes {rest} are all -1; at most one axis can take the rest of the devices")

  def given(self) -> dict[str, int]:
    """The sizes that were set, in axis order."""
    return {name: getattr(self, name) for name in AXES if getattr(self, name) is not None}

  @classmethod
  def from_sizes(cls, **sizes: int) -> "MeshConfig":
    """Like the constructor, but an unknown axis name is a ValueError that lists the known ones."""
    unknown = sorted(set(sizes) - set(AXES))
    if unknown:
      raise ValueError(f"unknown mesh axis {unknown[0]!r}; the mesh axes are {list(AXES)}")
    return cls(**sizes)

  @classmethod
  def parse(cls, text: str) -> "MeshConfig":
    """'data=2,model=4' -> MeshConfig(data=2, model=4) (the CLI's --mesh)."""
    sizes: dict[str, int] = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
      name, sep, value = part.partition("=")
      name = name.strip()
      if not sep:
        raise ValueError(f"--mesh entry {part!r} is not axis=size (e.g. 'data=2,model=4')")
      try:
        sizes[name] = int(value)
      except ValueError:
        raise ValueError(f"--mesh entry {part!r}: size {value.strip()!r} is not an integer") from None
    return cls.from_sizes(**sizes)

  def shape(self, num_devices: int) -> dict[str, int]:
    """Resolved sizes {axis: size} for `num_devices` devices; raises if they do not fit."""
    sizes = self.given()
    unset = [name for name in AXES if name not in sizes]
    if -1 not in sizes.values() and unset:
      sizes[unset.pop(0)] = -1
    sizes.update({name: 1 for name in unset})
    known = math.prod(s for s in sizes.values() if s != -1)
    if known > num_devices:
      raise ValueError(f"mesh {_fmt(sizes)} needs {known} devices but only {num_devices} are available; "
                       f"make the axes smaller (their product must be <= {num_devices})")
    for name, size in sizes.items():
      if size == -1:
        if num_devices % known:
          raise ValueError(f"mesh {_fmt(sizes)}: {num_devices} devices do not divide into {known} x {name}; "
                           f"give {name} an explicit size")
        sizes[name] = num_devices // known
    return {name: sizes[name] for name in AXES}

  def build(self, devices: Sequence[jax.Device] | None = None) -> Mesh:
    """The `jax.sharding.Mesh` over `devices` (default: every device of every process)."""
    devices = list(jax.devices() if devices is None else devices)
    sizes = self.shape(len(devices))
    n = math.prod(sizes.values())
    if n < len(devices) and jax.process_count() > 1:
      raise ValueError(f"mesh {_fmt(sizes)} uses {n} of {len(devices)} devices; across several processes the "
                       "mesh must span every device (leave one axis unset or -1)")
    # Auto axes: shardings are placements chosen here; XLA's partitioner inserts the collectives.
    return jax.make_mesh(tuple(sizes.values()), AXES, axis_types=(AxisType.Auto,) * len(AXES),
                         devices=devices[:n])


def as_mesh(mesh: MeshConfig | Mesh) -> Mesh:
  """A Mesh from a MeshConfig (built over all devices) or a Mesh given as is."""
  if isinstance(mesh, Mesh):
    missing = [a for a in AXES if a not in mesh.axis_names]
    if missing:
      raise ValueError(f"mesh has axes {list(mesh.axis_names)}; jaxgen's rules need {list(AXES)} (missing {missing})")
    return mesh
  if isinstance(mesh, MeshConfig):
    return mesh.build()
  raise TypeError(f"expected a MeshConfig or a jax.sharding.Mesh, got {type(mesh).__name__}")


def _fmt(sizes: dict[str, int]) -> str:
  return "(" + ", ".join(f"{k}={v}" for k, v in sizes.items()) + ")"
