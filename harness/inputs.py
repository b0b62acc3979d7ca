"""Which topology a file given on the command line means: a topology file, or a scenario naming one.

`verify` (and later `run`) accept either. A scenario's `topology:` is a path (relative to the
scenario file, then to the current folder, then to the project's `topologies/`) or an inline
mapping; its optional `nodes:` maps region -> node count and its optional `node_limits:` (memory,
pids per node) and `node_sysctls:` override the topology's.
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import pydantic

from emulator.schema import ConfigError, config_error_from_pydantic, load_yaml_mapping
from emulator.topology import (MAX_NODES_PER_REGION, NicFields, NodeLimits, check_node_sysctls, Topology, load_topology,
                               topology_from_dict)

from .paths import PROJECT_ROOT


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
    return topology_from_document(load_yaml_mapping(path), str(path))


def topology_from_document(data: dict, path: str) -> Topology:
    """The topology a parsed topology or scenario document describes (`path`: where it came from,
    for relative topology names and for errors)."""
    if "regions" in data:
        return topology_from_dict(data, source=path)
    if "topology" not in data:
        raise ConfigError("", "neither a topology (no 'regions:') nor a scenario (no 'topology:')", source=path)
    ref = data["topology"]
    if isinstance(ref, dict):
        topology = topology_from_dict(ref, source=f"{path} (topology)")
    elif isinstance(ref, str):
        found = resolve_relative(ref, Path(path), "topologies")
        if found is None:
            raise ConfigError("topology", f"topology file {ref!r} not found", source=path)
        topology = load_topology(found)
    else:
        raise ConfigError("topology", "expected a file name or an inline topology mapping", source=path)
    nodes = data.get("nodes")
    if nodes is not None:
        if not isinstance(nodes, dict):
            raise ConfigError("nodes", "expected a mapping region -> node count", source=path)
        for region, count in nodes.items():
            if region not in topology.regions:
                raise ConfigError(f"nodes.{region}", f"unknown region (regions: {', '.join(topology.regions)})", source=path)
            if isinstance(count, bool) or not isinstance(count, int) or not 1 <= count <= MAX_NODES_PER_REGION:
                raise ConfigError(f"nodes.{region}", f"expected an integer in [1, {MAX_NODES_PER_REGION}], got {count!r}", source=path)
        topology = topology.with_nodes(nodes)
    if data.get("node_limits") is not None:
        try:
            limits = NodeLimits.model_validate(data["node_limits"])
        except pydantic.ValidationError as exc:
            raise config_error_from_pydantic(path, exc).prefixed("node_limits") from None
        topology = topology.with_limits(limits)
    if data.get("node_sysctls") is not None:
        try:
            sysctls = check_node_sysctls(data["node_sysctls"])
        except ValueError as exc:
            raise ConfigError("node_sysctls", str(exc), source=path) from None
        topology = topology.with_sysctls(sysctls)
    if data.get("nic") is not None:
        try:
            nic = NicFields.model_validate(data["nic"])
        except pydantic.ValidationError as exc:
            raise config_error_from_pydantic(path, exc).prefixed("nic") from None
        topology = topology.with_nic(nic.rate)
    return topology
