"""The core every layer shares: a laid-out tensor (:class:`Layout`, :class:`MeshAxis`) and the one mesh resolver.

Both know only names and sizes (no devices), so plans for 2,048-device meshes resolve on a laptop.
"""

from .layout import Layout, MeshAxis
from .mesh import resolve_mesh

__all__ = ["Layout", "MeshAxis", "resolve_mesh"]
