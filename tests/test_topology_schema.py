"""Topology graphs (Flame's TAG in YAML): the built-ins are recognised as their kinds, and every mistake in a
graph, a schema file or the settings is one line naming what and where, with a hint."""
import dataclasses
import textwrap
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from elasticflow.errors import ElasticFlowError
from elasticflow.config.topology import ROLES, Topology, TopologyConfig, validate

CONF = Path(__file__).resolve().parents[1] / "conf" / "topology"
BUILTINS = ("ring", "hierarchical", "parameter_server", "local_sgd", "diloco")


def builtin(name, **overrides):
    """conf/topology/NAME.yaml merged into the schema, as Hydra composes it (an unknown key or a wrong type
    in the file fails here), with ``overrides`` set on top."""
    root = OmegaConf.merge({"topology": OmegaConf.structured(TopologyConfig)}, OmegaConf.load(CONF / f"{name}.yaml"))
    for key, value in overrides.items():
        OmegaConf.update(root, f"topology.{key}", value, merge=False)
    return root.topology


def from_file(tmp_path, text, name="schema.yaml", **settings):
    path = tmp_path / name
    path.write_text(textwrap.dedent(text))
    return validate({**dataclasses.asdict(TopologyConfig()), "schema": str(path), **settings})


def refusal(call, *args, **kwargs) -> ElasticFlowError:
    with pytest.raises(ElasticFlowError) as info:
        call(*args, **kwargs)
    err = info.value
    assert "\n" not in err.message and err.hint and "\n" not in err.hint, f"not one line with a hint: {err}"
    return err


@pytest.mark.parametrize("name", BUILTINS)
def test_every_builtin_validates_and_is_recognised_as_its_kind(name):
    topology = validate(builtin(name))
    assert isinstance(topology, Topology) and topology.kind == name and topology.name == name
    assert [r.name for r in topology.roles if r.data_consumer] == ["trainer"]


def test_the_shapes_of_the_builtins():
    hier = validate(builtin("hierarchical"))
    assert [(c.name, c.tags, c.func_tags["trainer"]) for c in hier.channels] == [
        ("intra-group", ("default/$group",), ("reduce", "broadcast")), ("leaders", ("default",), ("allreduce",))]
    ps = validate(builtin("parameter_server", replica=2))
    assert ps.role("aggregator").replica == 2 and not ps.role("aggregator").data_consumer
    assert ps.channels[0].func_tags == {"trainer": ("push", "pull"), "aggregator": ("aggregate", "distribute")}


def test_group_size_splits_a_host_by_local_slot():
    from elasticflow.config.schema import compose

    topo = validate(compose("models/digits_mlp.py", ["topology=hierarchical", "topology.group_size=2"]).topology)
    assert [topo.group_of("h1", slot=s) for s in range(4)] == ["h1/0", "h1/0", "h1/1", "h1/1"]
    assert topo.group_of("h1") == "h1"
    with pytest.raises(ElasticFlowError, match="topology.group_size must be a positive integer"):
        validate({**OmegaConf.to_container(compose("models/digits_mlp.py", ["topology=hierarchical"]).topology),
                  "group_size": 0})


def test_the_composed_config_carries_the_topology():
    from elasticflow.config import schema as config

    assert validate(config.compose("models/linear.py").topology).kind == "ring"
    cfg = config.compose("models/linear.py", ["topology=diloco", "topology.sync_every=8"])
    assert validate(cfg.topology).kind == "diloco" and cfg.topology.sync_every == 8


RING = """\
    name: my ring
    roles:
      - name: trainer
        isDataConsumer: true
    channels:
      - name: ring
        pair: [trainer, trainer]
        funcTags: {trainer: [allreduce]}
"""


def test_a_schema_file_of_ones_own_replaces_the_graph(tmp_path):
    topology = from_file(tmp_path, RING)
    assert topology.kind == "ring" and topology.name == "my ring" and topology.source == str(tmp_path / "schema.yaml")


def test_a_flame_json_schema_is_read_and_its_func_tags_refused_naming_ours(tmp_path):
    flame = ('{\n\t"name": "A sample schema",\n\t"roles": [{\n\t\t"name": "trainer",\n\t\t"isDataConsumer": true\n'
             '\t}],\n\t"channels": [{\n\t\t"name": "param-channel",\n\t\t"pair": ["trainer", "trainer"],\n'
             '\t\t"groupBy": {"type": "tag", "value": ["default"]},\n\t\t"funcTags": {"trainer": ["ring_allreduce"]}'
             '\n\t}]\n}\n')
    err = refusal(from_file, tmp_path, flame, name="flame.json")
    assert err.message.endswith("channel 'param-channel': role 'trainer' has funcTag 'ring_allreduce', which "
                                "ElasticFlow's trainer does not provide")
    assert err.hint == "trainer provides: " + ", ".join(ROLES["trainer"].func_tags)


def test_an_unknown_func_tag_of_an_aggregator_lists_what_it_provides(tmp_path):
    err = refusal(from_file, tmp_path, """\
        roles: [{name: trainer, isDataConsumer: true}, {name: aggregator}]
        channels:
          - {name: p, pair: [trainer, aggregator], funcTags: {trainer: [push, pull], aggregator: [fetch]}}
    """)
    assert "channel 'p': role 'aggregator' has funcTag 'fetch'" in err.message
    assert err.hint == "aggregator provides: aggregate, distribute"


TRAINER = "roles: [{name: trainer, isDataConsumer: true}]\n"


@pytest.mark.parametrize("text, message, hint", [
    (TRAINER + "channels: [{name: c, pair: [trainer, aggregator], funcTags: {trainer: [push]}}]",
     "channel 'c' pairs role 'aggregator', which is not one of the roles (trainer)", "add role 'aggregator'"),
    (TRAINER + "channels: [{name: c, pair: [trainer], funcTags: {trainer: [allreduce]}}]",
     "channel 'c': pair must be two role names, got ['trainer']", "pair: [trainer, trainer]"),
    (TRAINER + "channels: [{name: c, pair: trainer, funcTags: {trainer: [allreduce]}}]",
     "channel 'c': pair must be two role names, got 'trainer'", "the roles are trainer"),
    (TRAINER + "channels: [{name: c, pair: [trainer, trainer, trainer], funcTags: {trainer: [allreduce]}}]",
     "pair must be two role names", "pair: [trainer, trainer]"),
    (TRAINER + """channels:
       - {name: up, pair: [trainer, trainer], groupBy: {type: tag, value: [default]},
          funcTags: {trainer: [reduce, broadcast]}}
       - {name: top, pair: [trainer, trainer], groupBy: {type: tag, value: [default/$group]},
          funcTags: {trainer: [allreduce]}}
     """, "channel 'top' (groupBy ['default/$group']) is upstream of channel 'up' (groupBy ['default']) but groups "
          "more specifically", "may not be more specific than a downstream one's"),
    ("roles: [{name: trainer, isDataConsumer: true}, {name: aggregator}]\n" + """channels:
       - {name: p, pair: [trainer, aggregator], groupBy: {type: tag, value: [default]},
          funcTags: {trainer: [push, pull], aggregator: [aggregate]}}
       - {name: a, pair: [aggregator, aggregator], groupBy: {type: tag, value: [default/$group]},
          funcTags: {aggregator: [distribute]}}
     """, "channel 'a' (groupBy ['default/$group']) is upstream of channel 'p'", "not be more specific"),
    ("roles: [{name: trainer, isDataConsumer: true}, {name: aggregator}]\n"
     "channels: [{name: c, pair: [trainer, trainer], funcTags: {trainer: [allreduce]}}]",
     "the graph is not connected: no channel path joins role(s) aggregator to the trainers", "add a channel"),
    ("roles: [{name: aggregator}]\nchannels: [{name: c, pair: [aggregator, aggregator], funcTags: {aggregator: "
     "[aggregate]}}]", "no role consumes data", "isDataConsumer: true"),
    ("roles: [{name: trainer, isDataConsumer: true, replica: 1}]\nchannels: []",
     "role 'trainer' consumes data and sets replica", "remove replica from role 'trainer'"),
    ("roles: [{name: trainer, isDataConsumer: true}, {name: aggregator, replica: 0}]\nchannels: []",
     "role 'aggregator': replica must be 1 or 2, got 0", "2 adds a standby"),
    ("roles: [{name: trainer, isDataConsumer: true}, {name: aggregator, replica: 3}]\nchannels: []",
     "role 'aggregator': replica must be 1 or 2, got 3", "replica: 1"),
    ("roles: [{name: trainer, isDataConsumer: true}, {name: trainer, isDataConsumer: true}]\nchannels: []",
     "two roles are named 'trainer'", "one entry"),
    (TRAINER + "channels: [{name: c, pair: [trainer, trainer], funcTags: {trainer: [allreduce]}},"
               " {name: c, pair: [trainer, trainer], funcTags: {trainer: [reduce]}}]",
     "two channels are named 'c'", "its own name"),
    ("roles: [{name: trainer, isDataConsumer: true, replicas: 2}]\nchannels: []",
     "role 'trainer' has an unknown key 'replicas'", "did you mean replica? it takes name, description, "
                                                     "isDataConsumer, replica"),
    (TRAINER + "channels: [{name: c, pair: [trainer, trainer], groupby: {}, funcTags: {trainer: [allreduce]}}]",
     "channel 'c' has an unknown key 'groupby'", "did you mean groupBy?"),
    (TRAINER + "channels: [{name: c, pair: [trainer, trainer], groupBy: {kind: tag, value: [default]}, "
               "funcTags: {trainer: [allreduce]}}]", "the groupBy of channel 'c' has an unknown key 'kind'", "type, value"),
    (TRAINER + "channel: []", "the schema has an unknown key 'channel'", "did you mean channels?"),
    (TRAINER + "channels: [{name: c, pair: [trainer, trainer], funcTags: {trainer: [allreduce], aggregator: [x]}}]",
     "channel 'c': funcTags names role 'aggregator', which is not in its pair ['trainer', 'trainer']", "pair"),
    ("roles: [{name: trainer, isDataConsumer: true}, {name: aggregator}]\n"
     "channels: [{name: c, pair: [trainer, aggregator], funcTags: {trainer: [push]}}]",
     "channel 'c': funcTags.aggregator must be a non-empty list of actions, got None", "aggregator: [aggregate]"),
    (TRAINER + "channels: [{name: c, pair: [trainer, trainer], groupBy: {type: tag, value: [us]}, "
               "funcTags: {trainer: [allreduce]}}]", "groupBy tag 'us' is not a path from default", "default/$group"),
    (TRAINER + "channels: [{name: c, pair: [trainer, trainer], groupBy: {type: tag, value: [default/$group/x]}, "
               "funcTags: {trainer: [allreduce]}}]", "groupBy tag 'default/$group/x' is not a path", "groupBy:"),
    (TRAINER + "channels: [{name: c, pair: [trainer, trainer], groupBy: {type: tag, value: [default/a, default]}, "
               "funcTags: {trainer: [allreduce]}}]", "groupBy tags ['default/a', 'default'] have different depths",
     "one level"),
    (TRAINER + "channels: [{name: c, pair: [trainer, trainer], groupBy: {type: region, value: [default]}, "
               "funcTags: {trainer: [allreduce]}}]", "groupBy type must be tag, got 'region'", "groupBy:"),
    ("roles: [{name: worker, isDataConsumer: true}]\nchannels: []",
     "role 'worker' has no implementation in ElasticFlow", "trainer, aggregator"),
    ("roles: [{name: trainer}]\nchannels: []",
     "role 'trainer' has isDataConsumer: false, but ElasticFlow's trainer trains on the data",
     "set isDataConsumer: true on role 'trainer'"),
    ("roles: [{name: trainer, isDataConsumer: yes please}]\nchannels: []",
     "role 'trainer': isDataConsumer must be true or false, got 'yes please'", "isDataConsumer: true"),
    (TRAINER + "channels: []", "channels must be a non-empty list of mappings, got []", "channels: [{name: ring"),
    ("roles: []\nchannels: []", "roles must be a non-empty list of mappings, got []", "roles: [{name: trainer"),
    ("roles: [trainer]\nchannels: []", "roles must be a non-empty list of mappings, got ['trainer']", "isDataConsumer"),
    (TRAINER + "channels: [{name: c, pair: [trainer, trainer], funcTags: {trainer: [push]}}]",
     "the graph is none of the topologies ElasticFlow has (ring, hierarchical, parameter_server, local_sgd, "
     "diloco)", "without groupBy is ring (funcTags [allreduce]), local_sgd ([average]) or diloco"),
    (TRAINER + """channels:
       - {name: a, pair: [trainer, trainer], funcTags: {trainer: [reduce, broadcast]}}
       - {name: b, pair: [trainer, trainer], funcTags: {trainer: [allreduce]}}
     """, "the graph is none of the topologies", "hierarchical is a channel grouped by [default/$group]"),
])
def test_a_mistake_in_the_graph_is_one_line_naming_it(tmp_path, text, message, hint):
    err = refusal(from_file, tmp_path, text)
    assert err.message.startswith(f"{tmp_path / 'schema.yaml'}: ")
    assert message in err.message
    assert hint in err.hint


def test_a_config_without_a_graph_or_schema_is_refused():
    err = refusal(validate, TopologyConfig())
    assert err.message == "topology.graph must be a mapping of roles and channels, got None"


def test_a_mistake_in_a_builtin_graph_names_topology_graph():
    err = refusal(validate, builtin("ring", **{"graph.channels": [{"name": "ring", "pair": ["trainer", "trainr"],
                                                                   "funcTags": {"trainer": ["allreduce"]}}]}))
    assert err.message == ("topology.graph: channel 'ring' pairs role 'trainr', which is not one of the roles "
                           "(trainer)")


@pytest.mark.parametrize("name, text, message", [
    ("absent.yaml", None, "absent.yaml: no such file"),
    ("bad.yaml", "roles: [a\nchannels: {", "bad.yaml is not YAML: expected ',' or ']', but got ':' at line 2, "
                                           "column 9"),
    ("list.yaml", "- name: trainer\n", "list.yaml holds list, not a mapping of roles and channels"),
    ("bad.json", '{"roles": [],}', "bad.json is not JSON: Expecting property name enclosed in double quotes at "
                                   "line 1, column 14"),
])
def test_a_schema_file_that_is_missing_or_not_yaml(tmp_path, name, text, message):
    if text is not None:
        (tmp_path / name).write_text(text)
    err = refusal(validate, {"schema": str(tmp_path / name)})
    assert err.message == f"topology.schema={tmp_path / name}{message[len(name):]}"
    assert "topology.schema=PATH" in err.hint


def test_a_directory_is_not_a_schema_file(tmp_path):
    assert refusal(validate, {"schema": str(tmp_path)}).message.endswith("no such file (a directory)")


@pytest.mark.parametrize("overrides, message, hint", [
    ({"sync_every": 0}, "topology.sync_every must be a positive integer, got 0", "topology.sync_every=16"),
    ({"sync_every": 2**31}, "topology.sync_every must be a positive integer, got 2147483648", "synchronisations"),
    ({"outer_lr": 0.0}, "topology.outer_lr must be a finite number > 0, got 0.0", "topology.outer_lr=0.7"),
    ({"outer_lr": float("inf")}, "topology.outer_lr must be a finite number > 0, got inf", "outer_lr"),
    ({"outer_momentum": 1.0}, "topology.outer_momentum must be a number in [0, 1), got 1.0", "never forgets"),
    ({"outer_momentum": -0.1}, "topology.outer_momentum must be a number in [0, 1), got -0.1", "=0.9"),
    ({"aggregators": 0}, "topology.aggregators must be a positive integer, got 0", "topology.aggregators=2"),
    ({"replica": 3}, "topology.replica must be 1 or 2, got 3", "standby"),
    ({"replica": 0}, "topology.replica must be 1 or 2, got 0", "standby"),
    ({"group_by": "rack"}, "topology.group_by must be one of host, node, realm, got 'rack'", "group_by=host"),
    ({"group_by": "realm"}, "topology.group_by=realm needs topology.realms, each host's realm",
     "topology.realms={node01:rack-a"),
    ({"realms": {"node01": "a"}}, "topology.realms is set but topology.group_by=host does not read it",
     "topology.group_by=realm"),
    ({"group_by": "realm", "realms": 3}, "topology.realms must be a mapping of host to realm, got 3", "node01:rack-a"),
    ({"group_by": "realm", "realms": {"node01": "us/west"}},
     "topology.realms: a realm must be a plain name (no '/'), got node01: 'us/west'", "rack-a"),
])
def test_a_bad_setting_is_one_line_naming_the_key(overrides, message, hint):
    err = refusal(validate, builtin("diloco", **overrides))
    assert err.message == message
    assert hint in err.hint


def test_an_unknown_setting_is_refused_when_validate_is_given_a_plain_mapping():
    err = refusal(validate, {**dataclasses.asdict(TopologyConfig()), "sync_evry": 4})
    assert err.message == "topology: the topology config has an unknown key 'sync_evry'"
    assert err.hint.startswith("did you mean sync_every?")


def test_a_builtin_file_with_an_unknown_key_fails_to_compose(tmp_path):
    (tmp_path / "typo.yaml").write_text("topology:\n  sync_evry: 4\n")
    with pytest.raises(Exception, match="sync_evry"):
        OmegaConf.merge({"topology": OmegaConf.structured(TopologyConfig)}, OmegaConf.load(tmp_path / "typo.yaml"))


def test_a_role_without_replica_takes_topology_replica_and_its_own_wins(tmp_path):
    ps = "roles: [{name: trainer, isDataConsumer: true}, {name: aggregator%s}]\nchannels: [{name: p, pair: " \
         "[trainer, aggregator], funcTags: {trainer: [push, pull], aggregator: [aggregate, distribute]}}]"
    assert from_file(tmp_path, ps % "", replica=2).role("aggregator").replica == 2
    assert from_file(tmp_path, ps % ", replica: 1", replica=2).role("aggregator").replica == 1


def test_group_of_resolves_group_by():
    assert validate(builtin("hierarchical")).group_of("hostA", node="nodeA") == "hostA"
    assert validate(builtin("hierarchical", group_by="node")).group_of("hostA", node="nodeA") == "nodeA"
    assert validate(builtin("hierarchical", group_by="node")).group_of("hostA") == "hostA"  # outside SLURM
    by_realm = validate(builtin("hierarchical", group_by="realm", realms={"hostA": "rack-a", "hostB": "rack-a"}))
    assert by_realm.group_of("hostB") == "rack-a"
    err = refusal(by_realm.group_of, "hostC")
    assert err.message == "host 'hostC' has no realm in topology.realms (group_by=realm)"
