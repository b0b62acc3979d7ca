"""Which topology a file given on the command line means: a topology file, or a scenario naming one.

`verify` (and later `run`) accept either. A scenario's `topology:` is a path (relative to the
scenario file, then to the current folder, then to the project's `topologies/`) or an inline
mapping; its optional `nodes:` maps region -> node count.
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional

from .schema import ConfigError, load_yaml_mapping
from .topology import MAX_NODES_PER_REGION, Topology, load_topology, topology_from_dict

PROJECT_ROOT = Path(__file__).resolve().parent.parent


def resolve_relative(name: str, base_file: Path, folder: str) -> Optional[Path]:
    """Find `name` next to `base_file`, in the current folder, or in the project's `folder`."""
    if not name or len(name) > 4096 or "\x00" in name:
        return None
    for candidate in (base_file.parent / name, Path(name), PROJECT_ROOT / folder / name):
        try:
            if candidate.is_file():
                return candidate
        except OSError:  # a name too long for the file system is simply not found
            continue
    return None


def topology_of(path: str) -> Topology:
    """The topology a topology or scenario file describes; ConfigError naming file and field."""
    data = load_yaml_mapping(path)
    if "regions" in data:
        return topology_from_dict(data, source=path)
    if "topology" not in data:
        raise ConfigError(path, "", "neither a topology (no 'regions:') nor a scenario (no 'topology:')")
    ref = data["topology"]
    if isinstance(ref, dict):
        topology = topology_from_dict(ref, source=f"{path} (topology)")
    elif isinstance(ref, str):
        found = resolve_relative(ref, Path(path), "topologies")
        if found is None:
            raise ConfigError(path, "topology", f"topology file {ref!r} not found")
        topology = load_topology(found)
    else:
        raise ConfigError(path, "topology", "expected a file name or an inline topology mapping")
    nodes = data.get("nodes")
    if nodes is not None:
        if not isinstance(nodes, dict):
            raise ConfigError(path, "nodes", "expected a mapping region -> node count")
        for region, count in nodes.items():
            if region not in topology.regions:
                raise ConfigError(path, f"nodes.{region}",
                                  f"unknown region (regions: {', '.join(topology.regions)})")
            if isinstance(count, bool) or not isinstance(count, int) or not 1 <= count <= MAX_NODES_PER_REGION:
                raise ConfigError(path, f"nodes.{region}",
                                  f"expected an integer in [1, {MAX_NODES_PER_REGION}], got {count!r}")
        topology = topology.with_nodes(nodes)
    return topology
