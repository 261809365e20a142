"""`elasticflow export`: a checkpoint's weights loaded back into a fresh instance of the user's own model.

Each model trains a few steps with the real CLI; the export is loaded the framework's own way
(``load_state_dict(strict=True)``, ``from_pretrained``, ``load_weights``) and its outputs are compared
with the checkpoint's tensors (equal, or a numpy forward pass of them within float32 rounding). The BERT, PEFT
and Keras exports run `elasticflow export` in this process (harness.cli), which imports their framework to load
the result anyway; a subprocess would only import it again. The plain modules' exports run in a subprocess.
"""
import json
import os
import pwd
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import pytest

import elasticflow
import elasticflow.checkpoint as ckpt
from elasticflow.train import model_file as modelfile
from elasticflow.config.schema import compose
from elasticflow.errors import ElasticFlowError

from harness import MODELS, cli, run_cli, train

# A masked-LM BERT with its decoder tied to the word embeddings (state_dict lists both), non-persistent
# position/token-type id buffers (not state), and a frozen token-type embedding.
BERT = '''
import numpy as np
import torch
from transformers import BertConfig, BertForMaskedLM

CONFIG = dict(vocab_size=50, hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64,
              max_position_embeddings=16, tie_word_embeddings=True)


def model(cfg):
    torch.manual_seed(cfg.seed)
    net = BertForMaskedLM(BertConfig(**CONFIG))
    net.bert.embeddings.token_type_embeddings.weight.requires_grad_(False)
    return net


def forward(ids, labels, net):
    return net(input_ids=ids, labels=labels).loss


def data(cfg):
    rng = np.random.default_rng(0)
    ids = rng.integers(0, 50, (64, 8))
    return ids, np.where(rng.random((64, 8)) < 0.3, ids, -100)
'''

# A plain module: a non-persistent buffer (not state), a persistent one, a frozen parameter; with
# model_args.dict it comes as {"net": module, "optimizer": ...} (checkpoint names "net.<key>").
NET = '''
import numpy as np
import torch
from elasticflow import optim


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(4, 3)
        self.head = torch.nn.Linear(3, 1)
        self.fc.bias.requires_grad_(False)
        self.register_buffer("scale", torch.tensor(2.0), persistent=False)
        self.register_buffer("offset", torch.full((1,), 0.5))

    def forward(self, x):
        return self.head(torch.tanh(self.fc(x)) * self.scale) + self.offset


def model(cfg):
    torch.manual_seed(cfg.seed)
    net = Net()
    if cfg.model_args.get("compile"):  # the wrapper's names gain "_orig_mod."; eager: compiles in a second
        net = torch.compile(net, backend="eager")
    return {"net": net, "optimizer": optim.Adam(0.05)} if cfg.model_args.get("dict") else net


def forward(x, y, net):
    net = net["net"] if isinstance(net, dict) else net
    return torch.nn.functional.mse_loss(net(x), y)


def data(cfg):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(64, 4)).astype(np.float32)
    return x, (x[:, :1] - x[:, 1:2]).astype(np.float32)
'''

STEPS = ["trainer.max_steps=3", "trainer.global_batch_size=16"]


def _weights(path):
    from safetensors.torch import load_file

    return load_file(str(path))


def _checkpoint_of(run_dir):
    path = ckpt.latest(run_dir / "checkpoints")
    return path, ckpt.load(path)


@pytest.fixture(scope="module")
def net_runs(tmp_path_factory):
    """The plain module trained as it is and as {"net": module, "optimizer": ...}: {form: (model file, run dir)}."""
    root = tmp_path_factory.mktemp("net")
    (root / "net.py").write_text(NET)
    runs = {}
    for form, extra in (("module", []), ("dict", ["+model_args.dict=true"])):
        train(root / "net.py", root / form, *STEPS, *extra, timeout=120)
        runs[form] = (root / "net.py", root / form)
    return runs


def test_bert_export_loads_strict_and_with_from_pretrained(tmp_path):
    import torch
    from transformers import BertForMaskedLM

    (tmp_path / "bert.py").write_text(BERT)
    run = tmp_path / "run"
    train(tmp_path / "bert.py", run, *STEPS, "optimizer=adamw", timeout=120)
    proc = cli(["export", run, "--to", tmp_path / "out"])  # in this process: transformers is imported here already
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "exported step 3 of" in proc.stdout and "BertForMaskedLM (save_pretrained)" in proc.stdout

    cfg = compose(str(tmp_path / "bert.py"))
    build = modelfile.load(str(tmp_path / "bert.py")).model
    weights = _weights(tmp_path / "out" / "model.safetensors")
    fresh, initial = build(cfg), build(cfg)
    assert set(weights) == set(fresh.state_dict())  # the decoder alias present, position_ids absent
    assert "cls.predictions.decoder.weight" in weights and "bert.embeddings.position_ids" not in weights
    fresh.load_state_dict(weights, strict=True)

    _, state = _checkpoint_of(run)
    aliases = {"cls.predictions.decoder.weight": "bert.embeddings.word_embeddings.weight",
               "cls.predictions.decoder.bias": "cls.predictions.bias"}  # tied: not in the checkpoint
    for name, tensor in weights.items():
        assert np.array_equal(tensor.numpy(), state[aliases.get(name, name)]), name
    frozen = "bert.embeddings.token_type_embeddings.weight"
    assert torch.equal(weights[frozen], initial.state_dict()[frozen])  # frozen: exported as it started
    assert not torch.equal(weights["cls.predictions.transform.dense.weight"],
                           initial.cls.predictions.transform.dense.weight)  # trained: not the initial values

    pretrained = BertForMaskedLM.from_pretrained(tmp_path / "out")
    embeddings = pretrained.bert.embeddings.word_embeddings.weight
    assert pretrained.cls.predictions.decoder.weight.data_ptr() == embeddings.data_ptr()  # tied again
    ids = torch.from_numpy(np.random.default_rng(1).integers(0, 50, (4, 8)))
    with torch.no_grad():
        logits = [m.eval()(input_ids=ids).logits for m in (fresh, pretrained)]
    assert torch.equal(logits[0], logits[1])
    assert not torch.equal(logits[0], initial.eval()(input_ids=ids).logits)


# GPT-2 with LoRA adapters on its attention (peft): the base frozen, only the adapters train. The LoRA
# tutorial's own file (docs/tutorial-lora.md), so this test also proves the tutorial's steps.
LORA = MODELS / "gpt2_lora.py"


def test_a_peft_adapter_exports_as_peft_loads_it_and_merged(tmp_path):
    """The adapter was exported only inside a full state_dict: PeftModel.from_pretrained found no
    adapter_config.json."""
    import runpy

    import torch
    peft = pytest.importorskip("peft")
    from transformers import GPT2LMHeadModel

    path = LORA
    run = tmp_path / "run"
    train(path, run, *STEPS, timeout=180)
    proc = cli(["export", run, "--to", tmp_path / "out"])  # in this process, as the BERT export above
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "peft adapter (save_pretrained), and the merged model in merged/" in proc.stdout
    written = {p.name for p in (tmp_path / "out").iterdir()}
    assert {"adapter_config.json", "adapter_model.safetensors", "merged"} <= written

    code = runpy.run_path(str(path))
    trained = code["model"](compose(str(path)))["net"]  # the trained weights, from the checkpoint by name
    _, state = _checkpoint_of(run)
    state = {k[len("net."):]: v for k, v in state.items() if k.startswith("net.")}  # model() returned {"net": ...}
    own = trained.state_dict()
    trained.load_state_dict({k: torch.from_numpy(state[k]) for k in own if k in state}, strict=False)
    lora = [k for k in own if "lora_B" in k]
    assert lora and all(np.abs(state[k]).max() > 0 for k in lora)  # trained: B starts at zero

    ids = torch.from_numpy(np.random.default_rng(1).integers(0, 128, (4, 32)))
    adapted = peft.PeftModel.from_pretrained(code["base"](0), tmp_path / "out")
    merged = GPT2LMHeadModel.from_pretrained(tmp_path / "out" / "merged")
    with torch.no_grad():
        expected = trained.eval()(input_ids=ids).logits
        assert torch.equal(adapted.eval()(input_ids=ids).logits, expected)
        np.testing.assert_allclose(merged.eval()(input_ids=ids).logits.numpy(), expected.numpy(), atol=1e-5)
        assert not torch.allclose(code["base"](0).eval()(input_ids=ids).logits, expected, atol=1e-3)


@pytest.mark.parametrize("form", ["module", "dict"])
def test_native_module_exports_its_own_keys(net_runs, form, tmp_path, restore_ops):
    import torch

    model_file, run = net_runs[form]
    if form == "module":  # the API; the CLI for the dict form (its model_args.dict comes from the run's .hydra)
        exported = elasticflow.export(run, tmp_path / "out")
        assert exported.form == "torch state_dict" and exported.files == ["model.safetensors"]
    else:
        run_cli(["export", run, "--to", tmp_path / "out"], timeout=120, check=True)
    weights = _weights(tmp_path / "out" / "model.safetensors")
    assert sorted(weights) == ["fc.bias", "fc.weight", "head.bias", "head.weight", "offset"]

    net = modelfile.load(str(model_file)).model(compose(str(model_file)))
    initial = {k: v.clone() for k, v in net.state_dict().items()}
    net.load_state_dict(weights, strict=True)
    _, state = _checkpoint_of(run)
    prefix = "net." if form == "dict" else ""
    w = {k: state[prefix + k] for k in weights}
    assert torch.equal(weights["fc.bias"], initial["fc.bias"])  # frozen
    assert not torch.equal(weights["fc.weight"], initial["fc.weight"])  # trained
    x = np.random.default_rng(2).normal(size=(8, 4)).astype(np.float32)
    expected = np.tanh(x @ w["fc.weight"].T + w["fc.bias"]) * 2.0 @ w["head.weight"].T + w["head.bias"] + w["offset"]
    with torch.no_grad():
        np.testing.assert_allclose(net(torch.from_numpy(x)).numpy(), expected, rtol=1e-6, atol=1e-6)


def test_a_compiled_module_trains_exports_and_resumes_under_its_own_names(net_runs, tmp_path):
    import torch

    model_file, plain = net_runs["module"]
    run = tmp_path / "compiled"
    proc = train(model_file, run, *STEPS, "+model_args.compile=true", timeout=180)
    assert "torch.compile: the first step compiles the model" in proc.stderr
    path, state = _checkpoint_of(run)
    assert not [n for n in state if "_orig_mod" in n]
    _, reference = _checkpoint_of(plain)
    assert sorted(state) == sorted(reference)
    for name in reference:  # the eager backend computes what the module does: the same model
        np.testing.assert_array_equal(state[name], reference[name], err_msg=name)
    # The export loads into a plain Net() with strict=True.
    elasticflow.export(run, tmp_path / "out")
    net = modelfile.load(str(model_file)).model(compose(str(model_file)))
    net.load_state_dict(_weights(tmp_path / "out" / "model.safetensors"), strict=True)
    # The checkpoint resumes without compile.
    train(model_file, run, "trainer.max_steps=5", "trainer.global_batch_size=16", "+model_args.compile=false",
          timeout=180)
    assert ckpt.read_metadata(ckpt.latest(run / "checkpoints"))["step"] == 5


def test_dict_of_arrays_exports_arrays_by_name(tmp_path):
    from safetensors.numpy import load_file

    train("linear.py", tmp_path / "run", *STEPS, timeout=120)
    proc = run_cli(["export", tmp_path / "run", "--to", tmp_path / "out"], timeout=120, check=True)
    assert "arrays by name" in proc.stdout
    _, state = _checkpoint_of(tmp_path / "run")
    arrays = load_file(str(tmp_path / "out" / "model.safetensors"))
    assert sorted(arrays) == sorted(n for n in state if not n.startswith("optimizer/"))
    assert all(np.array_equal(arrays[n], state[n]) for n in arrays)


def test_best_exports_the_best_checkpoint_not_the_newest(tmp_path):
    """`export --best`: the best by checkpoint.monitor, as the run's newest checkpoint ranks them (the LoRA
    tutorial exported the newest, step 440, when the best was 380). tests/models/callback_probe.py at lr 0.5:
    eval_loss at step 25 (0.59) beats step 30's (0.61)."""
    from safetensors.numpy import load_file

    probe = Path(__file__).parent / "models" / "callback_probe.py"
    run = tmp_path / "run"
    train(probe, run, "trainer.global_batch_size=64", "trainer.micro_batch_size=16", "optimizer.lr=0.5",
          "trainer.max_steps=30", "trainer.eval_every=5", "checkpoint.monitor=eval_loss", "checkpoint.save_top_k=1",
          "checkpoint.keep=1", timeout=120)
    (job,) = (run / "checkpoints").iterdir()
    assert {"step_25", "step_30"} <= {p.name for p in job.iterdir()}
    done = cli(["export", run, "--best", "--to", tmp_path / "best"])
    assert done.returncode == 0 and "exported step 25 of" in done.stdout, done.stderr
    arrays = load_file(str(tmp_path / "best" / "model.safetensors"))
    best, newest = ckpt.load(job / "step_25"), ckpt.load(job / "step_30")
    assert all(np.array_equal(arrays[n], np.asarray(best[n])) for n in arrays)
    assert not all(np.array_equal(arrays[n], np.asarray(newest[n])) for n in arrays)
    # a run that ranked nothing: one line that says how to rank
    train("linear.py", tmp_path / "plain", *STEPS, timeout=120)
    done = cli(["export", tmp_path / "plain", "--best", "--to", tmp_path / "none"])
    errors = [line for line in done.stderr.splitlines() if line.startswith("error:")]
    assert done.returncode == 2 and len(errors) == 1 and "records no best checkpoint" in errors[0], done.stderr
    assert "checkpoint.monitor=METRIC" in done.stderr and not (tmp_path / "none").exists()


def test_keras_export_loads_with_load_weights(tmp_path, restore_ops):
    model = MODELS / "keras_bn.py"
    run = tmp_path / "run"
    train(model, run, "backend=tensorflow", *STEPS, timeout=180)
    proc = cli(["export", run, "--to", tmp_path / "out"])  # in this process: it loads the weights with TF below
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "keras weights (save_weights)" in proc.stdout

    net = modelfile.load(str(model)).model(compose(str(model), ["backend=tensorflow"]))
    net.load_weights(str(tmp_path / "out" / "model.weights.h5"))
    _, s = _checkpoint_of(run)
    assert np.array_equal(net.get_layer("out").kernel.numpy(), s["out/kernel"])
    assert not np.array_equal(s["bn/moving_mean"], 0 * s["bn/moving_mean"])  # trained state, not keras's zeros
    x = np.random.default_rng(3).random((16, 64)).astype(np.float32)
    h = x @ s["hidden/kernel"]
    h = (h - s["bn/moving_mean"]) / np.sqrt(s["bn/moving_variance"] + 1e-3) * s["bn/gamma"] + s["bn/beta"]
    expected = np.maximum(h, 0) @ s["out/kernel"] + s["out/bias"]
    np.testing.assert_allclose(net(x, training=False).numpy(), expected, rtol=1e-5, atol=1e-5)


# A Keras 3 model on KERAS_BACKEND=torch (a torch.nn.Module too): trained by backend=torch, exported as keras
# weights; backend=tensorflow refuses it in one line. Keras reads KERAS_BACKEND once per process: one process of
# its own does all three (TensorFlow imported once, for the refusal).
KERAS_ON_TORCH = """
import json, sys
import keras
import numpy as np
import elasticflow
import elasticflow.checkpoint as ckpt
from elasticflow.config.schema import compose
from elasticflow.errors import ElasticFlowError
from elasticflow.trainer import ElasticTrainer

model, root = sys.argv[1], sys.argv[2]
steps = ["trainer.max_steps=1", "trainer.global_batch_size=16", "trainer.progress=false", "backend.threads=1"]
ElasticTrainer(model, compose(model, ["backend=torch", *steps]), run_dir=root + "/run").fit()
done = elasticflow.export(root + "/run", root + "/out", model=model, overrides=["backend=torch"])
sys.path.insert(0, root)
import keras_torch
net = keras_torch.model(None)
net.load_weights(root + "/out/model.weights.h5")
state = ckpt.load(ckpt.latest(root + "/run/checkpoints"))
equal = {v.path: bool(np.array_equal(v.numpy(), next(a for k, a in state.items() if k.endswith(v.path))))
         for v in net.weights}
try:
    ElasticTrainer(model, compose(model, ["backend=tensorflow", *steps]), run_dir=root + "/tf").fit()
    refused = None
except ElasticFlowError as exc:
    refused = [exc.message, exc.hint]
print(json.dumps({"form": done.form, "files": done.files, "equal": equal, "refused": refused}))
"""

KERAS_TORCH_MODEL = """
import keras
import numpy as np


def model(cfg):
    keras.utils.set_random_seed(0)
    return keras.Sequential([keras.Input((4,)), keras.layers.Dense(8, activation="relu", name="hidden"),
                             keras.layers.Dense(1, name="out")], name="net")


def forward(x, y, net):
    return keras.ops.mean(keras.ops.square(net(x)[:, 0] - y))


def data(cfg):
    x = np.random.default_rng(0).normal(size=(64, 4)).astype(np.float32)
    return x, x.sum(1).astype(np.float32)
"""


def test_a_keras_model_on_torch_exports_keras_weights_and_tensorflow_refuses_it(tmp_path):
    (tmp_path / "keras_torch.py").write_text(KERAS_TORCH_MODEL)
    (tmp_path / "script.py").write_text(KERAS_ON_TORCH)
    done = subprocess.run([sys.executable, str(tmp_path / "script.py"), str(tmp_path / "keras_torch.py"),
                           str(tmp_path)], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "KERAS_BACKEND": "torch"})
    assert done.returncode == 0, done.stderr[-3000:]
    got = json.loads(done.stdout.strip().splitlines()[-1])
    assert got["form"] == "keras weights (save_weights)" and got["files"] == ["model.weights.h5"]
    assert got["equal"] == dict.fromkeys(["net/hidden/kernel", "net/hidden/bias", "net/out/kernel",
                                          "net/out/bias"], True)
    message, hint = got["refused"]
    assert message.startswith("model() returned a Keras model built with KERAS_BACKEND=torch, which backend="
                              "tensorflow cannot train") and "\n" not in message
    assert "KERAS_BACKEND=tensorflow" in hint and "backend=torch" in hint


# ---------------------------------------------------------------- one line and a hint for each mistake
def test_mistakes_are_one_line_with_a_hint(net_runs, tmp_path, restore_ops):
    model_file, run = net_runs["module"]
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "keep.txt").write_text("mine")
    moved = tmp_path / "moved"
    shutil.copytree(run / "checkpoints", moved)  # a checkpoint away from its run's .hydra
    renamed = tmp_path / "renamed"
    shutil.copytree(run, renamed)
    overrides = renamed / ".hydra" / "overrides.yaml"
    overrides.write_text(overrides.read_text().replace(str(model_file), str(tmp_path / "gone.py")))
    (tmp_path / "other.py").write_text(NET.replace("Linear(3, 1)", "Linear(3, 2)"))
    cases = [
        ((tmp_path / "nothing", tmp_path / "o"), {}, "does not exist", "RUN_DIR/checkpoints/<job>/step_100"),
        ((tmp_path / "full", tmp_path / "o"), {}, "is not a checkpoint: no metadata.json", "or a run directory"),
        ((run, tmp_path / "full"), {}, "exists and is not empty", "export never overwrites"),
        ((moved, tmp_path / "o"), {}, "cannot tell which model file wrote", "--model MODEL.py"),
        ((renamed, tmp_path / "o"), {}, "gone.py, is not found", "pass its new path with --model"),
        ((moved, tmp_path / "o"), {"model": str(tmp_path / "gone.py")}, "gone.py' not found", "--model the Python"),
        ((moved, tmp_path / "o"), {"model": str(tmp_path / "other.py")},
         "does not fit the model other.py builds: head.bias: model has shape (2,), checkpoint has (1,)", "--model"),
        ((run, tmp_path / "o"), {"overrides": ["model_args.x"]}, "unexpected argument 'model_args.x'", "key=value"),
    ]
    for args, kwargs, message, hint in cases:
        with pytest.raises(ElasticFlowError) as info:
            elasticflow.export(*args, **kwargs)
        assert message in info.value.message and hint in info.value.hint, (message, str(info.value))
    assert not (tmp_path / "o").exists() and [p.name for p in (tmp_path / "full").iterdir()] == ["keep.txt"]

    proc = cli(["export", moved, "--to", tmp_path / "o"])
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert proc.stderr.splitlines() == [
        f"error: cannot tell which model file wrote '{ckpt.latest(moved)}': no .hydra/overrides.yaml in its run "
        "directory (trained with ElasticTrainer, or checkpoint.dir outside the run)",
        "hint: pass the model file and the overrides it trained with: --model MODEL.py [key=value ...]"]


@pytest.mark.skipif(os.geteuid() != 0, reason="plants files as another user (nobody): needs root (as CI has)")
def test_export_never_imports_a_model_file_a_stranger_named(net_runs, tmp_path, restore_ops):
    """With checkpoint.dir=/tmp/ef-x-..., anyone may create /tmp/.hydra/overrides.yaml above the checkpoint, naming
    a model file of theirs. ``nobody`` plants one there, and one in a team folder every user may write, each
    naming a model file that leaves a mark when it is imported: export reads the run's overrides only from
    folders that are the user's alone, says in one line which file it did not read and why, imports nothing of
    the stranger's, and with --model exports the run's weights. Inside a run of one's own, an overrides file
    another user owns is refused."""
    if os.path.lexists("/tmp/.hydra"):
        pytest.skip("/tmp/.hydra exists already: not this test's to plant or remove")
    model_file, run = net_runs["module"]
    mark = tmp_path / "imported"
    team = Path(tempfile.mkdtemp(prefix="ef-team-"))
    team.chmod(0o777)  # no sticky bit
    evil = Path(tempfile.mkdtemp(prefix="ef-evil-"))
    shutil.rmtree(evil)  # nobody's own: it makes it
    made = [Path("/tmp/.hydra"), evil, team]
    try:
        planted = subprocess.run(
            ["setpriv", "--reuid=nobody", "--regid=nogroup", "--clear-groups", "sh", "-c",
             f"set -e; mkdir {evil} /tmp/.hydra {team}/.hydra; "
             f"echo 'open(\"{mark}\", \"w\").write(\"imported\")' > {evil}/model.py; "
             f"echo '- model={evil}/model.py' > /tmp/.hydra/overrides.yaml; "
             f"cp /tmp/.hydra/overrides.yaml {team}/.hydra/overrides.yaml"], capture_output=True, text=True)
        assert planted.returncode == 0, planted.stderr
        for parent, mode in ((Path("/tmp"), "1777"), (team, "777")):
            folder = Path(tempfile.mkdtemp(prefix="ef-x-", dir=parent))
            made.append(folder)
            # Under the team folder only as trusted: `train` refuses a checkpoint folder others may swap.
            trusted = ["launcher.trust_shared_dirs=true"] if parent == team else []
            train(model_file, tmp_path / f"run-{mode}", *STEPS, f"checkpoint.dir={folder}", *trusted, timeout=120)
            proc = cli(["export", folder, "--to", tmp_path / f"o-{mode}"])
            assert proc.returncode == 2, proc.stderr
            assert proc.stderr.splitlines() == [
                f"error: cannot tell which model file wrote '{ckpt.latest(folder)}': no .hydra/overrides.yaml in its "
                "run directory (trained with ElasticTrainer, or checkpoint.dir outside the run); "
                f"{parent}/.hydra/overrides.yaml is not read: {parent} may be written by others (mode {mode})",
                "hint: pass the model file and the overrides it trained with: --model MODEL.py [key=value ...]"]
            exported = elasticflow.export(folder, tmp_path / f"o-{mode}", model=str(model_file))
            weights = _weights(exported.path / "model.safetensors")
            np.testing.assert_array_equal(weights["head.weight"].numpy(), ckpt.load(ckpt.latest(folder))["head.weight"])
            assert not mark.exists()
        mine = tmp_path / "mine"
        shutil.copytree(run, mine)
        os.chown(mine / ".hydra" / "overrides.yaml", pwd.getpwnam("nobody").pw_uid, -1)
        with pytest.raises(ElasticFlowError, match=f"overrides.yaml belongs to uid {pwd.getpwnam('nobody').pw_uid}, "
                                                   "not to you"):
            elasticflow.export(mine, tmp_path / "o-mine")
        assert not mark.exists()
    finally:
        for folder in made:
            shutil.rmtree(folder, ignore_errors=True)


@pytest.fixture
def restore_ops():
    from elasticflow import ops

    with ops.using():
        yield
