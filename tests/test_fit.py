"""``elasticflow.fit()`` (elasticflow/fitting.py), called from a user's script as a user would: a module of
functions, functions one by one, functions defined in the script itself, with 1 worker and with 3; and the
refusals of what worker processes cannot import."""
import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import elasticflow
from elasticflow.errors import ElasticFlowError
from elasticflow.fitting import model_file_text
from harness import COMMON, MODELS, REPO, assert_equivalent, world_sizes

OVERRIDES = [c for c in COMMON if not c.startswith("elastic.")] + ["trainer.max_steps=20"]


def _script(tmp_path: Path, body: str, name: str = "train_it.py") -> subprocess.CompletedProcess:
    """Run a user's script that calls elasticflow.fit(); it prints RESULT <json> on success."""
    path = tmp_path / name
    path.write_text(textwrap.dedent(body))
    return subprocess.run([sys.executable, str(path)], cwd=tmp_path, capture_output=True, text=True, timeout=300,
                          env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(REPO), "HOME": str(tmp_path)})


def _result(done: subprocess.CompletedProcess) -> dict:
    assert done.returncode == 0, done.stderr[-3000:]
    line = [ln for ln in done.stdout.splitlines() if ln.startswith("RESULT ")][-1]
    return json.loads(line[len("RESULT "):])


def test_a_module_with_one_and_with_three_workers_trains_the_same_model(tmp_path):
    runs = {}
    for workers in (1, 3):
        runs[workers] = tmp_path / f"w{workers}"
        done = _script(tmp_path, f"""
            import json, sys
            sys.path.insert(0, {str(MODELS)!r})
            import elasticflow, digits_mlp

            if __name__ == "__main__":
                result = elasticflow.fit(digits_mlp, overrides={OVERRIDES + [f'launcher.workers={workers}']!r},
                                         run_dir={str(runs[workers])!r})
                print("RESULT " + json.dumps(result))
            """)
        result = _result(done)
        assert result["step"] == 20 and Path(result["checkpoint"]).is_dir(), result
        assert "done: step=20" in done.stdout and "elasticflow | backend torch" in done.stderr  # the CLI's console
        assert result["eval_loss"] > 0  # digits_mlp's eval_data() came along
    assert set(world_sizes(runs[3])) == {3}
    assert_equivalent(runs[3], runs[1])


def test_functions_defined_in_the_script_itself_train_with_two_workers(tmp_path):
    """__main__'s functions: each worker imports the script under another name (the guard keeps it from
    training again), as multiprocessing's spawn does."""
    done = _script(tmp_path, f"""
        import json, sys
        import numpy as np
        sys.path.insert(0, {str(MODELS)!r})
        import elasticflow, digits_mlp

        def model(cfg):
            return digits_mlp.model(cfg)

        def forward(x, y, params):
            return digits_mlp.forward(x, y, params)

        def data(cfg):
            return digits_mlp.data(cfg)

        if __name__ == "__main__":
            result = elasticflow.fit(model=model, forward=forward, data=data,
                                     overrides={OVERRIDES + ['launcher.workers=2']!r}, run_dir="run")
            print("RESULT " + json.dumps(result))
        """)
    result = _result(done)
    assert result["step"] == 20 and "eval_loss" not in result
    assert "elasticflow_fit_main" in (tmp_path / "run" / "model_file.py").read_text()


@pytest.mark.parametrize("kwargs, message", [
    (dict(model=lambda cfg: {}), "model is a lambda"),
    (dict(forward=(lambda: (lambda x, y, params: x))()), "forward is a lambda"),
    (dict(data=3), "data is a int, not a function"),
])
def test_what_workers_cannot_import_is_one_line(kwargs, message):
    sys.path.insert(0, str(MODELS))
    try:
        import digits_mlp
    finally:
        sys.path.remove(str(MODELS))
    functions = {"model": digits_mlp.model, "forward": digits_mlp.forward, "data": digits_mlp.data, **kwargs}
    with pytest.raises(ElasticFlowError, match=message):
        model_file_text(functions)


def test_a_closure_and_a_missing_function_are_refused():
    def make():
        def forward(x, y, params):
            return x
        return forward
    with pytest.raises(ElasticFlowError, match="forward is a closure .*define forward with `def` at the top level"):
        model_file_text({"forward": make()})
    with pytest.raises(ElasticFlowError, match="fit\\(\\) needs forward, data"):
        elasticflow.fit(model=make())
    with pytest.raises(ElasticFlowError, match="fit\\(\\) takes a module or functions, got a str"):
        elasticflow.fit("models/digits_mlp.py")


def test_a_failed_run_raises_after_the_clis_one_line(tmp_path):
    done = _script(tmp_path, f"""
        import sys
        sys.path.insert(0, {str(MODELS)!r})
        import elasticflow, digits_mlp
        from elasticflow.errors import ElasticFlowError

        if __name__ == "__main__":
            try:
                elasticflow.fit(digits_mlp, overrides=["trainer.global_batch_size=0"], run_dir="run")
            except ElasticFlowError as exc:
                print("RAISED " + exc.message)
        """)
    assert "RAISED training failed (exit 2)" in done.stdout, done.stdout + done.stderr
    assert [ln for ln in done.stderr.splitlines() if ln.startswith("error: ")][0].startswith(
        "error: trainer.global_batch_size")


def test_a_config_dict_and_hydra_run_dir_train_as_the_overrides_would(tmp_path):
    """fit(config={...}) as a dict, nested or dotted, a list of dicts among its values; hydra.run.dir=D among
    the overrides is the run directory (it trained into D, then looked for its result elsewhere); the
    checkpoints are named after the module trained, not after the file fit() writes."""
    run = tmp_path / "into"
    done = _script(tmp_path, f"""
        import json, sys
        sys.path.insert(0, {str(MODELS)!r})
        import elasticflow, digits_mlp

        if __name__ == "__main__":
            result = elasticflow.fit(digits_mlp, overrides=["hydra.run.dir={run}"],
                                     config={{"trainer": {{"max_steps": 12, "global_batch_size": 64, "log_every": 1}},
                                              "launcher.workers": 2, "optimizer.name": "sgd",
                                              "optimizer.groups": [{{"params": ["b"], "lr": 0.01}}],
                                              "callbacks": {{"lr_monitor": True}}}})
            print("RESULT " + json.dumps(result))
        """)
    result = _result(done)
    assert result["step"] == 12 and Path(result["checkpoint"]).is_relative_to(run), result
    assert Path(result["checkpoint"]).parent.name.startswith("digits_mlp_"), result["checkpoint"]
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if "loss" in r]
    assert len(steps) == 12 and set(world_sizes(run)) == {2}
    assert steps[0]["lr_group0"] == pytest.approx(0.01)  # the group from the list of dicts


def test_two_run_directories_and_a_config_that_is_not_a_dict_are_one_line():
    with pytest.raises(ElasticFlowError, match="fit\\(\\) was given two run directories: a, b"):
        elasticflow.fit(model=print, forward=print, data=print, run_dir="a", overrides=["hydra.run.dir=b"])
    with pytest.raises(ElasticFlowError, match="fit\\(config=...\\) takes a dict, got a list"):
        elasticflow.fit(model=print, forward=print, data=print, config=["trainer.max_steps=3"])
