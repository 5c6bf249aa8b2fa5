"""Sharding through a mesh config: `MeshConfig`, the rules table, the memory planner, multi-host setup."""

from jaxgen.sharding.mesh import MeshConfig

__all__ = ["MeshConfig"]
