"""Topologies as graphs: Flame's Topology Abstraction Graph (TAG) in YAML, checked once at start.

A topology is a graph of *roles* (what a process does: ``trainer``, ``aggregator``) and *channels* (who talks
to whom, grouped how, doing what: ``funcTags``). ``topology=NAME`` picks a built-in graph from
``conf/topology/NAME.yaml``; ``topology.schema=PATH`` reads your own. :func:`validate` checks the graph
against the role implementations ElasticFlow has (:data:`ROLES`), recognises which kind of topology it is,
and returns a :class:`Topology` the rest of the code reads. docs/topologies.md is the user's page.

groupBy tags are paths from the root group ``default`` (every worker): ``default/rack-a`` is one group,
``default/$group`` is one group per value of the worker's group key, which ``topology.group_by`` chooses
(``host``, ``node``: SLURM's node name, ``realm``: ``topology.realms[host]``), resolved at run time
(:meth:`Topology.group_of`). A tag's depth is its number of parts.
"""
from __future__ import annotations

import difflib
import json
import math
from collections import deque
from dataclasses import asdict, dataclass, field, fields, is_dataclass
from pathlib import Path
from typing import Any, Dict, List, NamedTuple, Optional, Tuple

from ..errors import ElasticFlowError

KINDS = ("ring", "hierarchical", "parameter_server", "local_sgd", "diloco")
GROUP_BY = ("host", "node", "realm")
ROOT, GROUP = "default", "$group"  # a tag's first part, and the part resolved per worker
MAX_COUNT, MAX_WORKERS, MAX_REPLICA = 2**31 - 1, 65536, 2


class Implementation(NamedTuple):
    consumes_data: bool           # its processes train on the data (isDataConsumer must say so)
    func_tags: Tuple[str, ...]    # the actions it can take on a channel


# The role implementations ElasticFlow has, by role name: a role of the graph is named after the one it runs.
# A leader of the hierarchical topology is a trainer (reduce onto it, allreduce among leaders, broadcast back),
# not a role of its own: it trains too, so it is no extra process.
ROLES: Dict[str, Implementation] = {
    "trainer": Implementation(True, ("allreduce", "reduce", "broadcast", "push", "pull", "average", "outer_step")),
    "aggregator": Implementation(False, ("aggregate", "distribute")),
}

# What a graph of these roles and this many channels must look like to be one of KINDS (the hint when it is not).
SHAPES = {
    ("trainer", 1): "a trainer channel without groupBy is ring (funcTags [allreduce]), local_sgd ([average]) or "
                    "diloco ([outer_step])",
    ("trainer", 2): "hierarchical is a channel grouped by [default/$group] doing [reduce, broadcast] under one "
                    "grouped by [default] doing [allreduce]",
    ("aggregator,trainer", 1): "parameter_server is one channel without groupBy: trainer [push, pull], aggregator "
                               "[aggregate, distribute]",
}
SCHEMA_KEYS = ("name", "description", "roles", "channels")  # Flame's keys; name and description are labels
ROLE_KEYS = ("name", "description", "isDataConsumer", "replica")
CHANNEL_KEYS = ("name", "description", "pair", "groupBy", "funcTags")
GROUP_BY_KEYS = ("type", "value")


@dataclass
class TopologyConfig:
    """``topology``: the graph of roles and channels, and the settings of the kinds that read them.

    Note: ``realms`` and ``graph`` are ``Any``: omegaconf 2.3 cannot merge an override's dict into a null
    ``Dict[str, str]``, and config._refuse_added would refuse the keys of a ``{}`` default as added."""
    name: str = "ring"             # ring | hierarchical | parameter_server | local_sgd | diloco (topology=diloco)
    # your own graph: a YAML (or .json) file of roles and channels, read instead of topology.graph
    schema: Optional[str] = None
    group_by: str = "host"         # what $group in a groupBy tag stands for: host | node (SLURM's name) | realm
    realms: Any = None             # group_by=realm: each host's realm, e.g. topology.realms={node01:rack-a}
    # workers of one host per group, by their local slot (e.g. 4: two groups on a host of 8 GPUs in two
    # NVLink islands, or one per CPU socket); null = the whole host
    group_size: Optional[int] = None
    aggregators: int = 1           # parameter_server: shards of the parameters, each held by `replica` aggregators
    replica: int = 1               # parameter_server: aggregators per shard, 1 or 2 (a standby; a role's replica wins)
    sync_every: int = 16           # local_sgd, diloco: optimizer steps between synchronisations
    # local_sgd, diloco: model replicas, each training on its part of every global batch; fixed for the run
    # (not the number of workers: a worker trains several, or waits when there are more workers than replicas)
    replicas: int = 4
    outer_lr: float = 0.7          # diloco: learning rate of the outer Nesterov step on the averaged update
    outer_momentum: float = 0.9    # diloco: momentum of the outer step, in [0, 1)
    graph: Any = None              # the roles and channels; conf/topology/NAME.yaml sets them


@dataclass(frozen=True)
class Role:
    name: str
    data_consumer: bool
    replica: int                   # processes per instance; 1 for a data consumer (workers set their number)


@dataclass(frozen=True)
class Channel:
    name: str
    pair: Tuple[str, str]
    tags: Tuple[str, ...]          # groupBy's tags; ("default",) without groupBy: one group of everyone
    func_tags: Dict[str, Tuple[str, ...]]  # role name -> its actions on this channel

    @property
    def depth(self) -> int:
        """How specific the grouping is: 1 is everyone together, 2 one group per host (node, realm)."""
        return len(self.tags[0].split("/"))


@dataclass(frozen=True)
class Topology:
    """A checked graph: what :func:`validate` returns."""
    kind: str                      # one of KINDS, recognised from the graph's shape and funcTags
    name: str
    roles: Tuple[Role, ...]
    channels: Tuple[Channel, ...]
    group_by: str = "host"
    realms: Dict[str, str] = field(default_factory=dict)
    source: str = "topology.graph"  # where the graph came from: topology.graph or the schema file
    group_size: Optional[int] = None

    def role(self, name: str) -> Role:
        return next(r for r in self.roles if r.name == name)

    def group_of(self, host: str, node: Optional[str] = None, slot: Optional[int] = None) -> str:
        """The worker's group key, what ``$group`` stands for: its host, its SLURM node (``node``, else the
        host), or its host's realm; with ``group_size``, split by the worker's local ``slot``. Raises
        ElasticFlowError for a host topology.realms does not name."""
        if self.group_by == "realm":
            if host not in self.realms:
                raise ElasticFlowError(f"host {host!r} has no realm in topology.realms (group_by=realm)",
                                       f"add it, e.g. topology.realms={{{host}:rack-a,...}}")
            key = self.realms[host]
        else:
            key = (node or host) if self.group_by == "node" else host
        return key if self.group_size is None or slot is None else f"{key}/{slot // self.group_size}"


def this_workers_group(topology: Topology, slot: Optional[str]) -> str:
    """``group_of`` for the calling process: its hostname, SLURM's node name if set, its local ``slot`` (the
    launcher's ``ELASTICFLOW_LOCAL_SLOT``, a string, or None)."""
    import os
    import socket

    return topology.group_of(socket.gethostname(), os.environ.get("SLURMD_NODENAME"), int(slot) if slot else None)


def validate(topology_cfg: Any) -> Topology:
    """Check ``cfg.topology`` (the graph, or the file topology.schema names, and the settings) and return it
    as a :class:`Topology`. Raises ElasticFlowError, one line and a hint, for the first problem found.

    Example:
        >>> validate(compose("models/linear.py", ["topology=hierarchical"]).topology).kind
        'hierarchical'
    """
    cfg = _plain(topology_cfg)
    _check_settings(cfg)
    if cfg.get("schema"):
        src = str(cfg["schema"])
        graph = load_schema(src)
        name = graph.get("name") if isinstance(graph.get("name"), str) else Path(src).stem
    else:
        src, graph, name = "topology.graph", cfg.get("graph"), str(cfg.get("name", "ring"))
        if not isinstance(graph, dict):
            raise ElasticFlowError(f"topology.graph must be a mapping of roles and channels, got {graph!r}",
                                   "pick a built-in with topology=ring (conf/topology/), or pass topology.schema=PATH")
    _keys(graph, SCHEMA_KEYS, src, "the schema")
    roles = _roles(graph.get("roles"), src, cfg.get("replica", 1))
    channels = _channels(graph.get("channels"), roles, src)
    _check_graph(roles, channels, src)
    kind = _kind(roles, channels)
    if kind is None:
        shape = SHAPES.get((",".join(sorted(roles)), len(channels)))
        raise ElasticFlowError(f"{src}: the graph is none of the topologies ElasticFlow has ({', '.join(KINDS)})",
                               (f"{shape}; " if shape else "") + "conf/topology/*.yaml holds each (docs/topologies.md)")
    return Topology(kind, name, tuple(roles.values()), tuple(channels), str(cfg.get("group_by", "host")),
                    dict(cfg.get("realms") or {}), src, cfg.get("group_size"))


def load_schema(path: str) -> Dict[str, Any]:
    """The mapping in the YAML file ``path`` (JSON if it ends in .json: Flame's schemas indent with tabs,
    which YAML refuses)."""
    hint = "pass topology.schema=PATH to a YAML file of roles and channels (docs/topologies.md)"
    file = Path(path).expanduser()
    if not file.is_file():
        raise ElasticFlowError(f"topology.schema={path}: no such file" + (" (a directory)" if file.is_dir() else ""),
                               hint)
    text = file.read_text()
    try:
        if file.suffix == ".json":
            data = json.loads(text)
        else:
            import yaml  # PyYAML comes with Hydra (omegaconf)

            data = yaml.safe_load(text)
    except json.JSONDecodeError as exc:
        raise ElasticFlowError(f"topology.schema={path} is not JSON: {exc.msg} at line {exc.lineno}, "
                               f"column {exc.colno}", hint) from exc
    except Exception as exc:  # yaml.YAMLError
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        raise ElasticFlowError(f"topology.schema={path} is not YAML: {getattr(exc, 'problem', None) or exc}{where}",
                               hint) from exc
    if not isinstance(data, dict):
        raise ElasticFlowError(f"topology.schema={path} holds {type(data).__name__}, not a mapping of roles and "
                               "channels", hint)
    return data


# ---------------------------------------------------------------- the parts
def _plain(node: Any) -> Dict[str, Any]:
    """``node`` (a DictConfig, a TopologyConfig or a dict) as plain containers, interpolations resolved."""
    from omegaconf import OmegaConf

    if is_dataclass(node):
        return asdict(node)
    if OmegaConf.is_config(node):
        return OmegaConf.to_container(node, resolve=True)
    return dict(node)


def _keys(node: Dict[str, Any], known: Tuple[str, ...], src: str, what: str) -> None:
    for key in node:
        if key not in known:
            close = difflib.get_close_matches(str(key), known, n=1, cutoff=0.6)
            raise ElasticFlowError(f"{src}: {what} has an unknown key {key!r}",
                                   (f"did you mean {close[0]}? " if close else "") + f"it takes {', '.join(known)}")


def _label(node: Dict[str, Any], i: int, kind: str) -> str:
    return f"{kind} {node['name']!r}" if isinstance(node.get("name"), str) and node["name"] else f"{kind}s[{i}]"


def _items(nodes: Any, src: str, key: str, example: str) -> List[Tuple[int, Dict[str, Any]]]:
    """The mappings of the non-empty list ``nodes`` (the schema's roles or channels), with their index."""
    if not isinstance(nodes, list) or not nodes or not all(isinstance(n, dict) for n in nodes):
        raise ElasticFlowError(f"{src}: {key} must be a non-empty list of mappings, got {nodes!r}",
                               f"e.g. {key}: [{example}]")
    return list(enumerate(nodes))


def _roles(nodes: Any, src: str, default_replica: int) -> Dict[str, Role]:
    roles: Dict[str, Role] = {}
    for i, node in _items(nodes, src, "roles", "{name: trainer, isDataConsumer: true}"):
        label = _label(node, i, "role")
        _keys(node, ROLE_KEYS, src, label)
        name = node.get("name")
        if not isinstance(name, str) or name not in ROLES:
            raise ElasticFlowError(f"{src}: {label} has no implementation in ElasticFlow",
                                   f"a role is named after what it runs: {', '.join(ROLES)}")
        if name in roles:
            raise ElasticFlowError(f"{src}: two roles are named {name!r}", "give each role one entry")
        data = node.get("isDataConsumer", False)
        if not isinstance(data, bool):
            raise ElasticFlowError(f"{src}: {label}: isDataConsumer must be true or false, got {data!r}",
                                   "set isDataConsumer: true on the role that trains on the data")
        if data != ROLES[name].consumes_data:
            raise ElasticFlowError(f"{src}: {label} has isDataConsumer: {str(data).lower()}, but ElasticFlow's "
                                   f"{name} {'trains on' if not data else 'never reads'} the data",
                                   f"set isDataConsumer: {str(not data).lower()} on role {name!r}")
        if data and "replica" in node:
            raise ElasticFlowError(f"{src}: {label} consumes data and sets replica; replica is for roles that "
                                   "consume none (the number of trainers is the number of workers)",
                                   f"remove replica from role {name!r}")
        replica = node.get("replica", 1 if data else default_replica)
        if isinstance(replica, bool) or not isinstance(replica, int) or not 1 <= replica <= MAX_REPLICA:
            raise ElasticFlowError(f"{src}: {label}: replica must be 1 or 2, got {replica!r}",
                                   "replica: 1 runs one copy of each process; 2 adds a standby")
        roles[name] = Role(name, data, replica)
    return roles


def _channels(nodes: Any, roles: Dict[str, Role], src: str) -> List[Channel]:
    channels: List[Channel] = []
    example = "{name: ring, pair: [trainer, trainer], funcTags: {trainer: [allreduce]}}"
    for i, node in _items(nodes, src, "channels", example):
        label = _label(node, i, "channel")
        _keys(node, CHANNEL_KEYS, src, label)
        name = node.get("name")
        if not isinstance(name, str) or not name:
            raise ElasticFlowError(f"{src}: {label} has no name", "give each channel a name: name: param-channel")
        if any(c.name == name for c in channels):
            raise ElasticFlowError(f"{src}: two channels are named {name!r}", "give each channel its own name")
        pair = node.get("pair")
        if not (isinstance(pair, list) and len(pair) == 2 and all(isinstance(p, str) for p in pair)):
            raise ElasticFlowError(f"{src}: {label}: pair must be two role names, got {pair!r}",
                                   f"e.g. pair: [trainer, trainer]; the roles are {', '.join(roles)}")
        for role in (r for r in pair if r not in roles):
            raise ElasticFlowError(f"{src}: {label} pairs role {role!r}, which is not one of the roles "
                                   f"({', '.join(roles)})", f"add role {role!r} to roles, or pair two of them")
        channels.append(Channel(name, (pair[0], pair[1]), _group_by(node.get("groupBy"), src, label),
                                _func_tags(node.get("funcTags"), pair, src, label)))
    return channels


def _func_tags(tags: Any, pair: List[str], src: str, label: str) -> Dict[str, Tuple[str, ...]]:
    example = ", ".join(f"{r}: [{ROLES[r].func_tags[0]}]" for r in dict.fromkeys(pair))
    if not isinstance(tags, dict):
        raise ElasticFlowError(f"{src}: {label}: funcTags must map each role of the pair to its actions, "
                               f"got {tags!r}", f"e.g. funcTags: {{{example}}}")
    out = {}
    for role in tags:
        if role not in pair:
            raise ElasticFlowError(f"{src}: {label}: funcTags names role {role!r}, which is not in its pair "
                                   f"{pair}", "funcTags keys are the roles of the channel's pair")
    for role in dict.fromkeys(pair):
        actions = tags.get(role)
        if not (isinstance(actions, list) and actions and all(isinstance(a, str) for a in actions)):
            raise ElasticFlowError(f"{src}: {label}: funcTags.{role} must be a non-empty list of actions, "
                                   f"got {actions!r}", f"e.g. funcTags: {{{example}}}")
        provides = ROLES[role].func_tags
        for action in actions:
            if action not in provides:
                raise ElasticFlowError(f"{src}: {label}: role {role!r} has funcTag {action!r}, which ElasticFlow's "
                                       f"{role} does not provide", f"{role} provides: {', '.join(provides)}")
        out[role] = tuple(actions)
    return out


def _group_by(node: Any, src: str, label: str) -> Tuple[str, ...]:
    """The tags of a channel's groupBy, each checked (see the module's docstring); ("default",) without one."""
    if node is None:
        return (ROOT,)
    hint = "e.g. groupBy: {type: tag, value: [default/$group]}: one group per host (topology.group_by)"
    if not isinstance(node, dict):
        raise ElasticFlowError(f"{src}: {label}: groupBy must be a mapping, got {node!r}", hint)
    _keys(node, GROUP_BY_KEYS, src, f"the groupBy of {label}")
    if node.get("type", "tag") != "tag":
        raise ElasticFlowError(f"{src}: {label}: groupBy type must be tag, got {node.get('type')!r}", hint)
    tags = node.get("value")
    if not (isinstance(tags, list) and tags and all(isinstance(t, str) for t in tags)):
        raise ElasticFlowError(f"{src}: {label}: groupBy value must be a non-empty list of tags, got {tags!r}", hint)
    for tag in tags:
        parts = tag.split("/")
        if parts[0] != ROOT or not all(p and not p.isspace() for p in parts) or GROUP in parts[:-1]:
            raise ElasticFlowError(f"{src}: {label}: groupBy tag {tag!r} is not a path from {ROOT} (default, "
                                   f"default/NAME or default/{GROUP})", hint)
    if len({t.count("/") for t in tags}) > 1:
        raise ElasticFlowError(f"{src}: {label}: groupBy tags {tags} have different depths",
                               "the tags of one channel group at one level, e.g. [default/rack-a, default/rack-b]")
    return tuple(tags)


def _check_graph(roles: Dict[str, Role], channels: List[Channel], src: str) -> None:
    """A data-consuming role, every role reachable from it, and groupBy no more specific upstream."""
    if not any(r.data_consumer for r in roles.values()):
        raise ElasticFlowError(f"{src}: no role consumes data", "set isDataConsumer: true on the trainer role")
    distance = {r: 0 for r, role in roles.items() if role.data_consumer}  # channel hops from the data
    todo = deque(distance)
    while todo:
        role = todo.popleft()
        for other in sorted({r for c in channels if role in c.pair for r in c.pair} - set(distance)):
            distance[other] = distance[role] + 1
            todo.append(other)
    cut = [r for r in roles if r not in distance]
    if cut:
        raise ElasticFlowError(f"{src}: the graph is not connected: no channel path joins role(s) "
                               f"{', '.join(cut)} to the trainers", "add a channel that pairs each role with "
                                                                   "one the trainers reach")

    # Upstream is farther from the data: the sum of the pair's distances orders a chain's channels (a trainer
    # self-loop 0, trainer-aggregator 1, an aggregator self-loop 2). Of two at one level, a channel that
    # reduces onto its groups' leaders is below the one those leaders meet on (hierarchical's two channels).
    def level(c: Channel) -> Tuple[int, int]:
        reduces = any("reduce" in tags for tags in c.func_tags.values())
        return distance[c.pair[0]] + distance[c.pair[1]], 0 if reduces else 1

    for up in channels:
        for down in channels:
            if set(up.pair) & set(down.pair) and level(up) > level(down) and up.depth > down.depth:
                raise ElasticFlowError(
                    f"{src}: channel {up.name!r} (groupBy {list(up.tags)}) is upstream of channel {down.name!r} "
                    f"(groupBy {list(down.tags)}) but groups more specifically",
                    "an upstream channel's groupBy may not be more specific than a downstream one's: e.g. "
                    f"{down.name}: [default/$group], {up.name}: [default]")


def _kind(roles: Dict[str, Role], channels: List[Channel]) -> Optional[str]:
    """Which of KINDS the graph is, from its roles, channels and funcTags; None for none of them."""
    def tags(c: Channel, role: str = "trainer") -> set:
        return set(c.func_tags.get(role, ()))

    if set(roles) == {"trainer"} and len(channels) == 1 and channels[0].depth == 1:
        return {frozenset({"allreduce"}): "ring", frozenset({"average"}): "local_sgd",
                frozenset({"outer_step"}): "diloco"}.get(frozenset(tags(channels[0])))
    if set(roles) == {"trainer"} and len(channels) == 2:
        inner, outer = sorted(channels, key=lambda c: -c.depth)
        if inner.depth > outer.depth and outer.depth == 1 and tags(inner) == {"reduce", "broadcast"} \
                and tags(outer) == {"allreduce"}:
            return "hierarchical"
    if set(roles) == {"trainer", "aggregator"} and len(channels) == 1 and channels[0].depth == 1:
        c = channels[0]
        if set(c.pair) == set(roles) and tags(c) == {"push", "pull"} and \
                tags(c, "aggregator") == {"aggregate", "distribute"}:
            return "parameter_server"
    return None


def _count(high: int) -> Any:
    return lambda v: isinstance(v, int) and 1 <= v <= high


# The numeric settings: (in range, the range in words, hint). config_ranges.RANGES holds the same ranges, so
# compose() refuses them first with these words; they are checked here too for validate() on its own.
NUMBERS = {
    "sync_every": (_count(MAX_COUNT), "a positive integer",
                   "pass e.g. topology.sync_every=16 (optimizer steps between synchronisations)"),
    "replicas": (_count(MAX_WORKERS), "a positive integer",
                 "pass e.g. topology.replicas=4 (model replicas; each trains on its part of every global batch)"),
    "aggregators": (_count(MAX_WORKERS), "a positive integer",
                    "pass e.g. topology.aggregators=2 (shards, each held by topology.replica aggregators)"),
    "replica": (_count(MAX_REPLICA), "1 or 2", "pass topology.replica=2 for a standby of each shard, else 1"),
    "outer_lr": (lambda v: math.isfinite(v) and v > 0, "a finite number > 0", "pass e.g. topology.outer_lr=0.7"),
    "outer_momentum": (lambda v: 0 <= v < 1, "a number in [0, 1)",
                       "pass e.g. topology.outer_momentum=0.9 (0: none; 1 or more never forgets an update)"),
}


def _check_settings(cfg: Dict[str, Any]) -> None:
    """The settings beside the graph: keys, choices and ranges (config_ranges.RANGES holds the same ranges)."""
    _keys(cfg, tuple(f.name for f in fields(TopologyConfig)), "topology", "the topology config")
    g = cfg.get
    for key, (ok, wording, hint) in NUMBERS.items():
        value = g(key, getattr(TopologyConfig, key))
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not ok(value):
            raise ElasticFlowError(f"topology.{key} must be {wording}, got {value!r}", hint)
    if g("group_by", "host") not in GROUP_BY:
        raise ElasticFlowError(f"topology.group_by must be one of {', '.join(GROUP_BY)}, got {g('group_by')!r}",
                               "pass topology.group_by=host (node: SLURM's node name; realm: topology.realms)")
    realms = g("realms") or {}
    if not isinstance(realms, dict):
        raise ElasticFlowError(f"topology.realms must be a mapping of host to realm, got {realms!r}",
                               "pass e.g. topology.realms={node01:rack-a,node02:rack-b}")
    if g("group_by") == "realm" and not realms:
        raise ElasticFlowError("topology.group_by=realm needs topology.realms, each host's realm",
                               "pass e.g. topology.realms={node01:rack-a,node02:rack-a,node03:rack-b}")
    size = g("group_size")
    if size is not None and (isinstance(size, bool) or not isinstance(size, int) or size < 1):
        raise ElasticFlowError(f"topology.group_size must be a positive integer or null, got {size!r}",
                               "pass e.g. topology.group_size=4 (workers of a host per group), or null")
    if realms and g("group_by") != "realm":
        raise ElasticFlowError(f"topology.realms is set but topology.group_by={g('group_by')} does not read it",
                               "pass topology.group_by=realm, or leave topology.realms null")
    bad = [f"{h}: {r!r}" for h, r in realms.items() if not isinstance(r, str) or not r or "/" in r or r == GROUP]
    if bad:
        raise ElasticFlowError(f"topology.realms: a realm must be a plain name (no '/'), got {bad[0]}",
                               "pass e.g. topology.realms={node01:rack-a}")


def check_run(cfg: Any, kind: str) -> None:
    """The rest of the run's config against topology ``kind``: what local SGD and DiLoCo cannot run with
    (train/local_sgd.py), and what parameter servers cannot (replica/parameter_server.py), one line each. ``cfg``: the whole config."""
    if kind == "parameter_server":
        _check_servers(cfg)
    if kind not in ("local_sgd", "diloco"):
        return
    t, every = cfg.trainer, cfg.topology.sync_every
    if t.shard != "none":
        raise ElasticFlowError(f"topology={kind} keeps each replica's optimizer state whole; trainer.shard={t.shard} "
                               "shards one model's", "pass trainer.shard=none with this topology")
    if str(t.precision).strip().lower() in ("16", "fp16", "float16"):
        raise ElasticFlowError(f"topology={kind} does not run float16's loss scaling",
                               "pass trainer.precision=bf16 or 32 with this topology")
    if cfg.topology.replicas > t.global_batch_size:
        raise ElasticFlowError(f"topology.replicas={cfg.topology.replicas} is more than trainer.global_batch_size="
                               f"{t.global_batch_size}: each replica trains on its part of every global batch",
                               f"pass topology.replicas={t.global_batch_size} or fewer")
    if cfg.checkpoint.interval.epochs:
        raise ElasticFlowError(f"checkpoint.interval.epochs is not taken with topology={kind}: a round of "
                               "steps may go on across an epoch's end, and checkpoints are taken between rounds",
                               f"pass checkpoint.interval.epochs=null checkpoint.interval.steps={every * 10} "
                               "(a multiple of topology.sync_every)")
    iv = cfg.checkpoint.interval.steps
    if iv and iv % every:
        raise ElasticFlowError(f"checkpoint.interval.steps={iv} is not a multiple of topology.sync_every={every}: "
                               "checkpoints are taken between rounds", f"pass checkpoint.interval.steps="
                               f"{max(every, iv // every * every)}")
    if t.eval_every and t.eval_every % every:
        raise ElasticFlowError(f"trainer.eval_every={t.eval_every} is not a multiple of topology.sync_every={every}: "
                               "the model is evaluated between rounds", f"pass trainer.eval_every="
                               f"{max(every, t.eval_every // every * every)}")


def _check_servers(cfg: Any) -> None:
    t = cfg.trainer
    if t.shard != "none":
        raise ElasticFlowError(f"topology=parameter_server shards the optimizer state over its aggregators; "
                               f"trainer.shard={t.shard} would shard it over every worker",
                               "pass trainer.shard=none with this topology")
    what = "trainer.grad_clip" if t.grad_clip is not None else "float16's loss scaling" \
        if str(t.precision).strip().lower() in ("16", "fp16", "float16") else None
    if what:
        raise ElasticFlowError(f"topology=parameter_server does not run {what}: each aggregator holds the sum of "
                               "its shard only, and the whole gradient's norm is nowhere",
                               "remove trainer.grad_clip and pass trainer.precision=bf16 or 32 with this topology")
