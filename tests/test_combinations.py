"""Feature combinations: every pair of features users combine trains its oracle's model, or is refused in one
line before training (docs/combinations.md publishes the matrix this file runs).

The features are factors with levels. A *distribution* factor (how the job is spread: trainer.shard,
trainer.reproducible, the topology) must meet every other factor at each of its levels, its default too; a
*model or training* feature (precision, clipping, parameter groups, frozen parameters, activation checkpointing
in both styles, torch.compile, LoRA, BatchNorm, dropout, a mixture of experts, an optimizer of the framework's
own) must meet every other at each of its non-default levels. ``covering_rows`` deals those pairs into as few
runs as it can (a greedy pairwise covering array: each run turns on several features at once, and covers every
pair it holds), leaving out the pairs ElasticFlow refuses. Each run is 3 workers, 6 steps of tests/models/
combo_probe.py, compared with its oracle: the 1-worker run of the same model and training settings with
replicated state on a ring (under trainer.reproducible the same bits, ``==``; else 1e-5, float32's summation
order over 6 plain-SGD steps). One thread a worker on both sides: under bf16 and float16 another thread count
alone moves this model more than another number of workers does. Each refused pair is tried as a user would
and must end before training with one ``error:`` line and a hint.
"""
from __future__ import annotations

import itertools
import re
from pathlib import Path
from typing import Dict, List, Tuple

import pytest

from elasticflow._util.pages import ENV_STRICT
from harness import REPO, assert_bitwise, assert_equivalent, metrics, train, train_ok

COMBO = Path(__file__).parent / "models" / "combo_probe.py"
RUN = ["trainer.global_batch_size=24", "trainer.micro_batch_size=4", "trainer.max_steps=6", "trainer.log_every=1",
       "optimizer.lr=0.1", "backend.threads=1", "elastic.timeout_s=30", "elastic.heartbeat_timeout_s=10",
       "elastic.wait_s=120", "checkpoint.interval.steps=null", "+model_args.hidden=256"]
# Given-back pages fault (ELASTICFLOW_STRICT_PAGES): a unit that backward uses while out ends the run, where
# it would otherwise read zeros (256 wide: the block's 512 KiB are whole pages to give back)
STRICT = {ENV_STRICT: "1"}

# Each factor's levels, its default first.
FACTORS: Dict[str, tuple] = {
    "backend": ("torch", "tensorflow"),
    "shard": ("none", "optimizer", "gradients", "parameters"),
    "reproducible": (False, True),
    "topology": ("ring", "hierarchical", "parameter_server"),
    "precision": ("32", "bf16", "16"),
    "grad_clip": (False, True),
    "schedule": ("constant", "cosine"),
    "groups": (False, True),
    "frozen": (False, True),
    "checkpointing": ("none", "call", "forward"),
    "compile": (False, True),
    "lora": (False, True),
    "norm": ("layer", "batch"),
    "dropout": (False, True),
    "moe": (False, True),
    "native": ("off", "torch.optim", "keras"),
}
DISTRIBUTION = ("backend", "shard", "reproducible", "topology")
TORCH_ONLY = ("checkpointing", "compile", "lora", "moe")  # features of a torch module: no Keras counterpart here

Level = Tuple[str, object]
# The pairs ElasticFlow refuses, each with the words its one-line error must hold (docs/combinations.md shows
# them: they say why).
REFUSED: Dict[frozenset, str] = {
    frozenset({("backend", "tensorflow"), ("shard", "parameters")}):
        "trainer.shard=parameters is built for backend=torch",
    frozenset({("reproducible", True), ("shard", "gradients")}): "trainer.shard=gradients reduce-scatters float32",
    frozenset({("reproducible", True), ("topology", "parameter_server")}):
        "topology=parameter_server sums in float32",
    **{frozenset({("topology", "parameter_server"), ("shard", s)}):
       f"topology=parameter_server shards the optimizer state over its aggregators; trainer.shard={s}"
       for s in ("optimizer", "gradients", "parameters")},
    frozenset({("topology", "parameter_server"), ("grad_clip", True)}):
        "topology=parameter_server does not run trainer.grad_clip",
    frozenset({("topology", "parameter_server"), ("precision", "16")}):
        "topology=parameter_server does not run float16's loss scaling",
    **{frozenset({("groups", True), ("native", n)}): "model() returns its own optimizer, so optimizer.groups="
       for n in ("torch.optim", "keras")},
    **{frozenset({("native", "keras"), ("shard", s)}): f"trainer.shard={s} has no sharded update for keras_sgd"
       for s in ("optimizer", "gradients")},
    frozenset({("native", "keras"), ("topology", "parameter_server")}):
        "topology=parameter_server has no sharded update for keras_sgd",
}


def refused(a: Level, b: Level) -> bool:
    return frozenset({a, b}) in REFUSED


def _framework(level: Level) -> str:
    """The backend a level exists on ('' for both): a torch module's switches, each framework's optimizer."""
    f, v = level
    if f == "backend":
        return str(v)
    if f in TORCH_ONLY and v != FACTORS[f][0] or level == ("native", "torch.optim"):
        return "torch"
    return "tensorflow" if level == ("native", "keras") else ""


def not_applicable(a: Level, b: Level) -> bool:
    """Levels of two frameworks (a torch module's checkpointing with backend=tensorflow): nothing to combine."""
    return bool(_framework(a) and _framework(b) and _framework(a) != _framework(b))


def excluded(a: Level, b: Level) -> bool:
    return refused(a, b) or not_applicable(a, b)


def pairs_to_cover(factors: Dict[str, tuple]) -> set:
    """Every pair of levels of two factors that must meet in some run: a distribution factor's every level, a
    feature's non-default ones; the refused pairs left out."""
    def levels(f):
        return factors[f] if f in DISTRIBUTION else factors[f][1:]
    out = set()
    for f, g in itertools.combinations(factors, 2):
        for a in levels(f):
            for b in levels(g):
                if not excluded((f, a), (g, b)) and _fits(factors, {f: a, g: b}):
                    out.add(frozenset({(f, a), (g, b)}))
    return out


def _fits(factors: Dict[str, tuple], row: Dict[str, object]) -> bool:
    """Whether ROW can be completed without an excluded pair (``shard=parameters`` with a Keras optimizer cannot:
    the one is torch's, the other TensorFlow's)."""
    return _complete(factors, row) is not None


def _complete(factors: Dict[str, tuple], row: Dict[str, object]):
    """ROW with each other factor at its first level that excludes nothing in it (None: there is none)."""
    row = dict(row)
    for f in factors:
        if f not in row:
            fit = [v for v in factors[f] if not any(excluded((f, v), lv) for lv in row.items())]
            if not fit:
                return None
            row[f] = fit[0]
    return {f: row[f] for f in factors}


def covering_rows(factors: Dict[str, tuple]) -> List[Dict[str, object]]:
    """Runs that together hold every pair of ``pairs_to_cover``, none a refused pair. Greedy and deterministic:
    each run starts from the first pair not yet held (in a fixed order) and gives each other factor the level
    that holds the most pairs not yet held, its default where none would."""
    needed = pairs_to_cover(factors)
    order = {lv: i for i, lv in enumerate((f, v) for f in factors for v in factors[f])}
    rows = []
    while needed:
        first = min(needed, key=lambda p: sorted(order[lv] for lv in p))
        row = dict(first)
        for f in factors:
            if f in row:
                continue
            best, gain = None, -1
            for v in factors[f]:
                if any(excluded((f, v), (g, w)) for g, w in row.items()):
                    continue
                new = sum(frozenset({(f, v), (g, w)}) in needed for g, w in row.items())
                if new > gain or new == gain and v == factors[f][0]:  # the default where none holds more
                    best, gain = v, new
            assert best is not None, f"no level of {f} fits {row}"
            row[f] = best
        row = {f: row[f] for f in factors}
        rows.append(row)
        needed -= {frozenset(p) for p in itertools.combinations(row.items(), 2)}
    return rows


def _overrides(row: Dict[str, object], distributed: bool, workers: int = 3) -> List[str]:
    """The command line of ROW: its distribution factors only where DISTRIBUTED (the oracle is replicated, on a
    ring), its reproducibility on both sides (the oracle of a reproducible run is a reproducible run)."""
    out = [f"backend={row['backend']}", f"trainer.precision={row['precision']}"]
    if row["reproducible"]:
        out.append("trainer.reproducible=true")
    if row["grad_clip"]:
        out.append("trainer.grad_clip=0.5")
    if row["schedule"] != "constant":  # on the config's optimizer or the model's own (issue 63 item 2)
        out += [f"optimizer.schedule={row['schedule']}", "optimizer.warmup_steps=2"]
    if row["groups"]:
        out.append("optimizer.groups=[{params:[block],lr:0.01}]")  # LoRA's adapters are in the block too
    for key in ("frozen", "compile", "lora", "dropout", "moe"):
        if row[key]:
            out.append(f"+model_args.{key}=1")
    if row["native"] != "off":  # torch: model() returns a torch.optim.SGD; tensorflow: the model compiled with SGD
        out.append("+model_args.native=1")
    if row["checkpointing"] != "none":
        out.append(f"+model_args.checkpointing={row['checkpointing']}")
    if row["norm"] != "layer":
        out.append(f"+model_args.norm={row['norm']}")
    if distributed:
        out += [f"launcher.workers={workers}", f"trainer.shard={row['shard']}"]
        if row["topology"] != "ring":
            out.append(f"topology={row['topology']}")
        if row["shard"] == "parameters":  # the same units with LoRA (peft wraps the model in base_model.model)
            out.append("trainer.shard_units=[*embed,*norm,*block,*router,*experts,*head]")
        if row["topology"] == "hierarchical":
            out.append("topology.group_size=2")  # one host: two groups of its three workers
    return out


def _name(row: Dict[str, object]) -> str:
    """A run's id: its distribution and the features it turns on."""
    on = [k if v is True else f"{k}={v}" for k, v in row.items()
          if v is not False and (k in DISTRIBUTION or v != FACTORS[k][0])]
    return ",".join(on)


ROWS = covering_rows(FACTORS)


# ---------------------------------------------------------------- the matrix's own logic, in this process
def test_the_runs_hold_every_pair_and_no_refused_one():
    held = {frozenset(p) for row in ROWS for p in itertools.combinations(row.items(), 2)}
    assert pairs_to_cover(FACTORS) <= held
    assert not [p for p in held if p in REFUSED]
    assert len(ROWS) <= 20, len(ROWS)  # a pairwise array of these factors: the suite's budget


def test_the_docs_page_shows_the_matrix_this_file_runs():
    page = PAGE.read_text()
    assert MARK in page, f"{PAGE} lost its {MARK} line"
    assert page.split(MARK)[1].strip() == matrix_markdown().strip(), \
        "docs/combinations.md's matrix is not this file's: .venv/bin/python tests/test_combinations.py writes it"


def _show(v) -> str:
    return str(v).lower() if isinstance(v, bool) else str(v)


def _pair(pair: frozenset) -> str:
    return " with ".join(f"`{f}={_show(v)}`" for f, v in sorted(pair, key=lambda lv: list(FACTORS).index(lv[0])))


PAGE = REPO / "docs" / "combinations.md"
MARK = "<!-- the matrix: written by tests/test_combinations.py, do not edit below -->"


def matrix_markdown() -> str:
    """The matrix as docs/combinations.md shows it: the runs, the refused pairs, the pairs with nothing to test."""
    rows = ["| # | runs on 3 workers, compared with 1 | oracle |", "|---|---|---|"]
    for i, row in enumerate(ROWS, 1):
        oracle = "the same bits (`==`)" if row["reproducible"] else "within 1e-5"
        rows.append(f"| {i} | {_name(row).replace(',', ', ')} | {oracle} |")
    refused_rows = ["| pair | refused before training, with |", "|---|---|"]
    for pair in sorted(REFUSED, key=_pair):
        refused_rows.append(f"| {_pair(pair)} | {REFUSED[pair]} |")
    held = len(pairs_to_cover(FACTORS))
    return "\n".join([
        f"{len(ROWS)} runs hold all {held} pairs the matrix asks for; {len(REFUSED)} pairs are refused.", "",
        "### The runs", "", *rows, "", "### The refused pairs", "", *refused_rows, "",
        "### Nothing to combine", "",
        "With `backend=tensorflow`: " + ", ".join(f"`{f}`" for f in TORCH_ONLY) +
        " are switches of a torch module (a Keras model has none of them here), and the model's own optimizer "
        "is a Keras one (`native=keras`); with `backend=torch` it is a `torch.optim` one.", ""])


if __name__ == "__main__":  # .venv/bin/python tests/test_combinations.py: the docs page's matrix written anew
    text = PAGE.read_text()
    PAGE.write_text(text.split(MARK)[0] + MARK + "\n\n" + matrix_markdown())
    print(f"{PAGE}: {len(ROWS)} runs, {len(REFUSED)} refused pairs")


# ---------------------------------------------------------------- real processes
@pytest.mark.parametrize("row", ROWS, ids=_name)
def test_an_accepted_combination_trains_its_oracles_model(tmp_path, one_worker, row):
    # A torch oracle trains in this process (one_worker's here): a CLI job would import torch, peft and dynamo
    # again for each. TensorFlow's stay CLI jobs: TF's thread pools and op determinism, once set in a process,
    # stay, and one in this process measured no faster (each still traces its graphs).
    want = one_worker(*_overrides(row, distributed=False), model=COMBO, common=RUN, here=row["backend"] == "torch")
    run = tmp_path / "run"
    train_ok(run, *_overrides(row, distributed=True), model=COMBO, common=RUN, env=STRICT)
    assert len([r for r in metrics(run) if "loss" in r]) == 6
    if row["reproducible"]:
        assert_bitwise(run, want)
    else:
        assert_equivalent(run, want)


@pytest.mark.parametrize("pair", sorted(REFUSED, key=lambda p: sorted(map(str, p))),
                         ids=lambda p: "+".join(f"{f}={_show(v)}" for f, v in sorted(p, key=str)))
def test_a_refused_combination_is_one_line_before_training(tmp_path, pair):
    row = _complete(FACTORS, dict(pair))  # (native=keras with ...: on TensorFlow)
    # 2 workers, not 3: a refusal is the pair's, at any size, and each TensorFlow worker imports it (~3 s of CPU)
    out = train(COMBO, tmp_path / "run", *RUN, *_overrides(row, distributed=True, workers=2), check=False,
                timeout=120)
    text = out.stdout + out.stderr
    errors = [line for line in text.splitlines() if line.startswith("error:")]
    assert out.returncode != 0 and len(errors) == 1, text[-2000:]
    assert re.search(re.escape(REFUSED[pair]), errors[0]), errors[0]
    assert any(line.startswith("hint:") for line in text.splitlines()), text[-2000:]
    assert not (tmp_path / "run" / "metrics.jsonl").exists() or not metrics(tmp_path / "run")
