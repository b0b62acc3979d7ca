"""Topology files: regions, node counts and the per-pair link matrix, validated with named limits.

A topology file is plain data (see topologies/aws-4region.yaml). `load_topology` returns a
`Topology` whose `link(src_region, dst_region)` gives the resolved one-way `LinkSpec` for every
ordered pair, intra-region included. Nothing here touches the system.
"""

from __future__ import annotations

import ipaddress
import math
import re
from dataclasses import dataclass, field, replace
from typing import Annotated, Any, Optional

import pydantic
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from .linkspec import LinkSpec
from .schema import ConfigError, config_error_from_pydantic, load_yaml_mapping
from .units import UnitError, parse_fraction, parse_rate_bit_s, parse_size_bytes, parse_time_ms

# Named limits (units in the names). They bound what the emulator can represent faithfully.
MAX_ONE_WAY_DELAY_MS = 10_000.0
MIN_RATE_BIT_S = 8_000.0          # 1 KB/s: slower than this, a single MTU takes 1.5 s to serialize
MAX_RATE_BIT_S = 100e9
MIN_QUEUE_BYTES = 3_000           # two full-size frames
MAX_QUEUE_BYTES = 1 << 30
MAX_NODES_PER_REGION = 1024
MAX_NODES_TOTAL = 4096
MAX_REGIONS = 64
DEFAULT_ADDRESS_POOL = "10.201.0.0/16"
# A node's holder (a small Python as PID 1) takes ~10 MB; below this nothing useful runs in a node.
MIN_NODE_MEMORY_BYTES = 32 * 1000**2
MAX_NODE_MEMORY_BYTES = 1 << 50
MIN_NODE_PIDS = 8                 # the holder and a shell pipeline
MAX_NODE_PIDS = 4_194_304         # the kernel's pid_max ceiling
REGION_NAME_PATTERN = r"^[a-z][a-z0-9]{0,14}$"
MAX_SOCKET_BUFFER_BYTES = 1 << 30  # tcp_rmem / tcp_wmem entries (the plan's own ceiling)
CONGESTION_CONTROL_PATTERN = re.compile(r"^[a-z][a-z0-9_]{0,15}$")  # TCP_CA_NAME_MAX is 16
# Every node's NIC, each way, where the topology names none: 10 Gbit/s in and 10 Gbit/s out at
# once, an EC2 instance with a sustained "10 Gigabit" (m5.12xlarge, c5.9xlarge: `aws ec2
# describe-instance-types ... NetworkInfo.NetworkPerformance`); the EC2 User Guide's "Amazon EC2
# instance network bandwidth" says an instance's figure holds inbound and outbound simultaneously.
DEFAULT_NIC_RATE_BIT_S = 10e9


def _bounded(value: float, low: float, high: float, what: str, shown: str) -> float:
    if not (low <= value <= high) or math.isnan(value):
        raise ValueError(f"{what} {shown} out of range [{low:g}, {high:g}]")
    return value


def bounded_time_ms(value: Any, what: str, low: float = 0.0, high: float = MAX_ONE_WAY_DELAY_MS) -> float:
    try:
        ms = parse_time_ms(value)
    except UnitError as exc:
        raise ValueError(str(exc)) from None
    return _bounded(ms, low, high, what + " (ms)", repr(value))


def bounded_rate_bit_s(value: Any, what: str = "rate") -> float:
    try:
        bit_s = parse_rate_bit_s(value)
    except UnitError as exc:
        raise ValueError(str(exc)) from None
    return _bounded(bit_s, MIN_RATE_BIT_S, MAX_RATE_BIT_S, what + " (bit/s)", repr(value))


class LinkFields(BaseModel):
    """Shaping fields shared by defaults, intra-region settings and link entries."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    rtt: Optional[float] = Field(None, description="round-trip time; one-way delay is half of it")
    delay: Optional[float] = Field(None, description="one-way delay")
    rate: Optional[float] = None
    jitter: Optional[float] = None
    loss: Optional[float] = None
    queue: Optional[int] = None

    @field_validator("rtt", mode="before")
    @classmethod
    def _rtt(cls, v):
        return None if v is None else bounded_time_ms(v, "rtt", high=2 * MAX_ONE_WAY_DELAY_MS)

    @field_validator("delay", "jitter", mode="before")
    @classmethod
    def _delay(cls, v, info):
        return None if v is None else bounded_time_ms(v, info.field_name)

    @field_validator("rate", mode="before")
    @classmethod
    def _rate(cls, v):
        return None if v is None else bounded_rate_bit_s(v)

    @field_validator("loss", mode="before")
    @classmethod
    def _loss(cls, v):
        if v is None:
            return None
        try:
            fraction = parse_fraction(v)
        except UnitError as exc:
            raise ValueError(str(exc)) from None
        return _bounded(fraction, 0.0, 1.0, "loss", repr(v))

    @field_validator("queue", mode="before")
    @classmethod
    def _queue(cls, v):
        if v is None or v == "auto":
            return None
        try:
            size = parse_size_bytes(v)
        except UnitError as exc:
            raise ValueError(f"{exc} (or \"auto\" for bandwidth-delay product)") from None
        return int(_bounded(size, MIN_QUEUE_BYTES, MAX_QUEUE_BYTES, "queue (bytes)", repr(v)))

    @model_validator(mode="after")
    def _rtt_or_delay(self):
        if self.rtt is not None and self.delay is not None:
            raise ValueError("give either rtt or delay (one-way), not both")
        return self

    def one_way_ms(self) -> Optional[float]:
        if self.delay is not None:
            return self.delay
        if self.rtt is not None:
            return self.rtt / 2.0
        return None


class LinkEntry(LinkFields):
    """A `links:` entry: `between: [a, b]` (both directions) or `from: a` + `to: b` (one direction)."""

    between: Optional[list[str]] = None
    from_: Optional[str] = Field(None, alias="from")
    to: Optional[str] = None

    model_config = ConfigDict(extra="forbid", frozen=True, populate_by_name=True)

    @model_validator(mode="after")
    def _endpoints(self):
        if self.between is not None:
            if self.from_ is not None or self.to is not None:
                raise ValueError("give either between: [a, b] or from:/to:, not both")
            if len(self.between) != 2:
                raise ValueError(f"between needs exactly two regions, got {len(self.between)}")
            if self.between[0] == self.between[1]:
                raise ValueError("between needs two different regions (use intra_region for one)")
        else:
            if self.from_ is None or self.to is None:
                raise ValueError("each link needs between: [a, b] or both from: and to:")
            if self.from_ == self.to:
                raise ValueError("from and to must be different regions (use intra_region for one)")
            if self.rtt is not None:
                raise ValueError("a one-direction link takes delay (one-way), not rtt")
        return self

    def directions(self) -> list[tuple[str, str]]:
        if self.between is not None:
            a, b = self.between
            return [(a, b), (b, a)]
        return [(self.from_, self.to)]


class NodeLimits(BaseModel):
    """Per-node resource limits (`node_limits:` in a topology or scenario); None: unlimited."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    memory: Optional[int] = Field(None, description="bytes for everything the node runs, e.g. \"4GB\"")
    pids: Optional[int] = Field(None, description="processes and threads in the node")

    @field_validator("memory", mode="before")
    @classmethod
    def _memory(cls, v):
        if v is None:
            return None
        if isinstance(v, int) and not isinstance(v, bool):
            raise ValueError(f"memory {v!r} needs a unit, e.g. \"4GB\" or \"512MiB\"")
        try:
            size = parse_size_bytes(v)
        except UnitError as exc:
            raise ValueError(str(exc)) from None
        return int(_bounded(size, MIN_NODE_MEMORY_BYTES, MAX_NODE_MEMORY_BYTES, "memory (bytes)", repr(v)))

    @field_validator("pids", mode="before")
    @classmethod
    def _pids(cls, v):
        if v is None:
            return None
        if isinstance(v, bool) or not isinstance(v, int):
            raise ValueError(f"pids must be a whole number of processes, got {v!r}")
        return int(_bounded(v, MIN_NODE_PIDS, MAX_NODE_PIDS, "pids", repr(v)))


def _quoted(value) -> str:
    """The hint for a number written as a string (``'0'`` in YAML): the value must be a number."""
    return " (a number: write it without quotes)" if isinstance(value, str) and value.strip().isdigit() else ""


def _switch(*allowed: int):
    def check(value) -> str:
        if isinstance(value, bool) or not isinstance(value, int) or value not in allowed:
            raise ValueError(f"expected one of {', '.join(map(str, allowed))}, got {value!r}{_quoted(value)}")
        return str(value)
    return check


def _whole(low: int, high: int):
    def check(value) -> str:
        if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
            raise ValueError(f"expected a whole number in [{low}, {high}], got {value!r}{_quoted(value)}")
        return str(value)
    return check


def _socket_buffers(value) -> str:
    """min, default and max bytes, as "4096 131072 16777216", [4096, 131072, 16777216] or with units."""
    items = value.split() if isinstance(value, str) else value
    if not isinstance(items, (list, tuple)) or len(items) != 3:
        raise ValueError(f"expected three sizes (min default max), e.g. \"4096 131072 16MiB\", got {value!r}")
    sizes = []
    for item in items:
        if isinstance(item, bool):
            raise ValueError(f"{item!r} is not a size")
        try:
            size = int(item) if isinstance(item, int) or str(item).isdigit() else int(parse_size_bytes(item))
        except (UnitError, ValueError) as exc:
            raise ValueError(str(exc)) from None
        sizes.append(int(_bounded(size, 1, MAX_SOCKET_BUFFER_BYTES, "size (bytes)", repr(item))))
    if not sizes[0] <= sizes[1] <= sizes[2]:
        raise ValueError(f"needs min <= default <= max, got {sizes[0]} {sizes[1]} {sizes[2]}")
    return " ".join(map(str, sizes))


def _congestion_control(value) -> str:
    if not isinstance(value, str) or not CONGESTION_CONTROL_PATTERN.match(value):
        raise ValueError(f"expected a congestion control's name such as bbr, cubic or reno, got {value!r}")
    return value


# The sysctls a node may set: each is per network namespace on Linux >= 5.x (so setting it in one
# node changes no other node and not the host), with the check of its value. Left out on purpose:
# net.core.rmem_max/wmem_max/rmem_default/wmem_default and net.core.default_qdisc (machine-wide:
# read-only inside a namespace) and anything outside net.*.
NODE_SYSCTLS = {
    "net.ipv4.tcp_slow_start_after_idle": _switch(0, 1),
    "net.ipv4.tcp_congestion_control": _congestion_control,
    "net.ipv4.tcp_rmem": _socket_buffers,
    "net.ipv4.tcp_wmem": _socket_buffers,
    "net.ipv4.tcp_notsent_lowat": _whole(1, (1 << 32) - 1),
    "net.ipv4.tcp_no_metrics_save": _switch(0, 1),
    "net.ipv4.tcp_autocorking": _switch(0, 1),
    "net.ipv4.tcp_sack": _switch(0, 1),
    "net.ipv4.tcp_timestamps": _switch(0, 1, 2),
    "net.ipv4.tcp_window_scaling": _switch(0, 1),
    "net.ipv4.tcp_ecn": _switch(0, 1, 2),
    "net.ipv4.tcp_mtu_probing": _switch(0, 1, 2),
    "net.ipv4.tcp_tso_win_divisor": _whole(0, 255),
    "net.ipv4.tcp_min_tso_segs": _whole(1, 255),
    "net.ipv4.tcp_limit_output_bytes": _whole(1, 1 << 30),
    "net.ipv4.tcp_syn_retries": _whole(1, 127),
    "net.core.somaxconn": _whole(1, 1 << 20),
    "net.core.optmem_max": _whole(1, 1 << 30),
}


def check_node_sysctls(value) -> dict[str, str]:
    """`node_sysctls:` checked: known per-namespace keys, values in range, as the strings written
    to /proc/sys (ValueError naming the key otherwise)."""
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise ValueError("expected a mapping sysctl -> value, e.g. {net.ipv4.tcp_slow_start_after_idle: 0}")
    checked = {}
    for key, raw in value.items():
        check = NODE_SYSCTLS.get(key)
        if check is None:
            why = "not a per-namespace net.* sysctl" if not str(key).startswith("net.") else "not one wanbench knows"
            raise ValueError(f"{key!r}: {why} (known: {', '.join(sorted(NODE_SYSCTLS))})")
        try:
            checked[key] = check(raw)
        except ValueError as exc:
            raise ValueError(f"{key}: {exc}") from None
    return checked


class NicFields(BaseModel):
    """A node's NIC (`nic:` in a topology, or in one of its regions): its rate each way, shared by
    every flow the node sends (out) and, separately, by every flow it receives (in)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    rate: float = Field(description="bit/s each way, e.g. \"10Gbit\"")

    @field_validator("rate", mode="before")
    @classmethod
    def _rate(cls, v):
        return bounded_rate_bit_s(v)


class RegionEntry(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    nodes: Annotated[int, Field(ge=1, le=MAX_NODES_PER_REGION, strict=True)] = 1
    nic: Optional[NicFields] = None  # this region's nodes' NIC; None: the topology's


class TopologyFile(BaseModel):
    """The YAML document, validated."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")
    description: str = ""
    source: str = ""
    address_pool: str = DEFAULT_ADDRESS_POOL
    regions: dict[Annotated[str, Field(pattern=REGION_NAME_PATTERN)], RegionEntry] = Field(
        min_length=1, max_length=MAX_REGIONS)
    defaults: LinkFields = LinkFields()
    intra_region: LinkFields = LinkFields()
    links: list[LinkEntry] = []
    node_limits: NodeLimits = NodeLimits()
    # sysctls set inside every node's namespace (NODE_SYSCTLS lists the known ones); a scenario's
    # node_sysctls override these key by key
    node_sysctls: dict[str, str] = {}
    # every node's NIC each way (a region's `nic:` overrides it); None: DEFAULT_NIC_RATE_BIT_S
    nic: Optional[NicFields] = None

    @field_validator("node_sysctls", mode="before")
    @classmethod
    def _node_sysctls(cls, v):
        return check_node_sysctls(v)

    @field_validator("address_pool")
    @classmethod
    def _pool(cls, v: str):
        try:
            net = ipaddress.IPv4Network(v, strict=True)
        except ValueError as exc:
            raise ValueError(f"not an IPv4 network such as 10.201.0.0/16: {exc}") from None
        if not net.is_private:
            raise ValueError(f"{v} is not a private range; use e.g. 10.201.0.0/16")
        if net.prefixlen > 28:
            raise ValueError(f"{v} is too small; use a prefix length of at most /28")
        return v

    @model_validator(mode="after")
    def _matrix(self):
        total = sum(r.nodes for r in self.regions.values())
        if total > MAX_NODES_TOTAL:
            raise ValueError(f"{total} nodes in all, more than {MAX_NODES_TOTAL}")
        pool_size = ipaddress.IPv4Network(self.address_pool).num_addresses - 2
        if total > pool_size:
            raise ValueError(f"address_pool {self.address_pool} has {pool_size} addresses for {total} nodes")
        return self


@dataclass(frozen=True)
class Topology:
    """A validated topology: regions in file order and a complete one-way link matrix."""

    name: str
    source_file: str
    regions: dict[str, int]                 # region -> node count
    links: dict[tuple[str, str], LinkSpec]  # ordered (src_region, dst_region), src != dst
    intra_region: LinkSpec
    address_pool: str
    description: str = ""
    memory_bytes: Optional[int] = None   # per node (node_limits.memory); None: unlimited
    pids_max: Optional[int] = None       # per node (node_limits.pids); None: unlimited
    node_sysctls: tuple = ()             # ((key, value as written to /proc/sys), ...), in file order
    # region -> the NIC rate (bit/s) of each of its nodes, each way; a region not named has
    # DEFAULT_NIC_RATE_BIT_S (topology_from_dict names every region)
    nic_rate_bit_s: dict = field(default_factory=dict)

    def region_nic_bit_s(self, region: str) -> float:
        """The NIC rate (bit/s, each way) of every node of `region`."""
        return self.nic_rate_bit_s.get(region, DEFAULT_NIC_RATE_BIT_S)

    def with_nic(self, rate_bit_s: float) -> "Topology":
        """The same network with every node's NIC at `rate_bit_s` each way (a scenario's override)."""
        return replace(self, nic_rate_bit_s={region: float(rate_bit_s) for region in self.regions})

    def with_limits(self, limits: "NodeLimits") -> "Topology":
        """The same network with these node limits where they are given (a scenario's override)."""
        return replace(self, memory_bytes=self.memory_bytes if limits.memory is None else limits.memory,
                       pids_max=self.pids_max if limits.pids is None else limits.pids)

    def with_sysctls(self, sysctls: dict[str, str]) -> "Topology":
        """The same network with these node sysctls set over the topology's, key by key (a
        scenario's override; values already checked by check_node_sysctls)."""
        merged = dict(self.node_sysctls)
        merged.update(sysctls)
        return replace(self, node_sysctls=tuple(merged.items()))

    def link(self, src_region: str, dst_region: str) -> LinkSpec:
        if src_region == dst_region:
            return self.intra_region
        return self.links[(src_region, dst_region)]

    def with_nodes(self, nodes_per_region: dict[str, int]) -> "Topology":
        """Same matrix, other node counts (scenarios set them)."""
        unknown = set(nodes_per_region) - set(self.regions)
        if unknown:
            raise KeyError(f"unknown region(s) {sorted(unknown)}")
        return replace(self, regions={r: nodes_per_region.get(r, n) for r, n in self.regions.items()})

    def scaled(self, delay_scale: float = 1.0, rate_bit_s: Optional[float] = None) -> "Topology":
        """A sweep point: every inter-region delay times `delay_scale`; every rate set to `rate_bit_s`."""
        if delay_scale < 0:
            raise ValueError("delay_scale must be >= 0")

        def change(spec: LinkSpec, inter: bool) -> LinkSpec:
            return replace(
                spec,
                one_way_delay_ms=spec.one_way_delay_ms * delay_scale if inter else spec.one_way_delay_ms,
                rate_bit_s=rate_bit_s if (rate_bit_s is not None and inter) else spec.rate_bit_s,
            )

        return replace(
            self,
            links={pair: change(spec, True) for pair, spec in self.links.items()},
            intra_region=self.intra_region,
        )

    @property
    def node_count(self) -> int:
        return sum(self.regions.values())


# Values used where neither the link nor `defaults` says otherwise.
_BUILTIN_DEFAULTS = dict(rate_bit_s=1e9, jitter_ms=0.0, loss_fraction=0.0, queue_bytes=None)
_BUILTIN_INTRA = LinkSpec(one_way_delay_ms=0.05, rate_bit_s=10e9)


def _resolve(fields: LinkFields, fallback: LinkFields, base: dict, where: str) -> LinkSpec:
    one_way = fields.one_way_ms()
    if one_way is None:
        one_way = fallback.one_way_ms()
    if one_way is None:
        raise ValueError(f"{where}: no rtt or delay given (and none in defaults)")

    def pick(name, base_key):
        value = getattr(fields, name)
        if value is None:
            value = getattr(fallback, name)
        return base[base_key] if value is None else value

    jitter = pick("jitter", "jitter_ms")
    if jitter > one_way:
        raise ValueError(f"{where}: jitter {jitter:g}ms larger than the one-way delay {one_way:g}ms")
    return LinkSpec(
        one_way_delay_ms=one_way,
        rate_bit_s=pick("rate", "rate_bit_s"),
        jitter_ms=jitter,
        loss_fraction=pick("loss", "loss_fraction"),
        queue_bytes=pick("queue", "queue_bytes"),
    )


def _nic_of(region: RegionEntry, doc: TopologyFile) -> float:
    given = region.nic or doc.nic
    return DEFAULT_NIC_RATE_BIT_S if given is None else given.rate


def topology_from_dict(data: dict, source: str = "<topology>") -> Topology:
    """Validate a topology document (already parsed YAML) into a `Topology`; raise ConfigError."""
    try:
        doc = TopologyFile.model_validate(data)
    except pydantic.ValidationError as exc:
        raise config_error_from_pydantic(source, exc) from None

    links: dict[tuple[str, str], LinkSpec] = {}
    for index, entry in enumerate(doc.links):
        field = f"links[{index}]"
        for region in entry.directions()[0]:
            if region not in doc.regions:
                known = ", ".join(doc.regions)
                raise ConfigError(field, f"unknown region {region!r} (regions: {known})", source=source)
        for pair in entry.directions():
            if pair in links:
                raise ConfigError(field, f"link {pair[0]}->{pair[1]} given twice", source=source)
            try:
                links[pair] = _resolve(entry, doc.defaults, _BUILTIN_DEFAULTS, f"{pair[0]}->{pair[1]}")
            except ValueError as exc:
                raise ConfigError(field, str(exc), source=source) from None

    names = list(doc.regions)
    for a in names:
        for b in names:
            if a != b and (a, b) not in links and (b, a) not in links and doc.defaults.one_way_ms() is not None:
                # `defaults` with a delay describes every pair no link entry mentions
                for pair in ((a, b), (b, a)):
                    links[pair] = _resolve(LinkFields(), doc.defaults, _BUILTIN_DEFAULTS, f"{pair[0]}->{pair[1]}")
            if a != b and (a, b) not in links:
                if (b, a) in links:
                    message = (f"link {a}->{b} missing: {b}->{a} is given one-way, so the matrix is "
                               f"asymmetric and needs both directions (or use between: [{a}, {b}])")
                else:
                    message = (f"no link between {a} and {b}: every pair of regions needs one "
                               f"(or give defaults a delay or rtt for all pairs)")
                raise ConfigError("links", message, source=source)

    intra_base = dict(rate_bit_s=_BUILTIN_INTRA.rate_bit_s, jitter_ms=0.0, loss_fraction=0.0, queue_bytes=None)
    fallback = LinkFields(delay=f"{_BUILTIN_INTRA.one_way_delay_ms}ms")
    try:
        intra = _resolve(doc.intra_region, fallback, intra_base, "intra_region")
    except ValueError as exc:
        raise ConfigError("intra_region", str(exc), source=source) from None

    return Topology(
        name=doc.name,
        source_file=source,
        regions={name: region.nodes for name, region in doc.regions.items()},
        links=links,
        intra_region=intra,
        address_pool=doc.address_pool,
        description=doc.description,
        memory_bytes=doc.node_limits.memory,
        pids_max=doc.node_limits.pids,
        node_sysctls=tuple(doc.node_sysctls.items()),
        nic_rate_bit_s={name: _nic_of(region, doc) for name, region in doc.regions.items()},
    )


def load_topology(path) -> Topology:
    """Read and validate a topology YAML file; raise ConfigError naming the file and field."""
    return topology_from_dict(load_yaml_mapping(path), source=str(path))
