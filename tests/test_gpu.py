"""ElasticFlow on a GPU (issue #16): skipped, with the reason, where torch sees no CUDA device.

Run them with ``scripts/ops/gpu_check.sh`` on a GPU machine (it also runs scripts/bench/bench_gpu.py). What one
GPU allows: training in bf16 and float16, workers sharing the GPU over gloo with a kill and recovery,
the model one worker trains (BatchNorm, dropout) on the GPU, a GPU checkpoint resumed on the CPU, and sharded
state (``trainer.shard``, all three stages) with a kill. NCCL's recovery needs two GPUs or more.
"""
import functools
import os
import signal
import subprocess
import sys
import threading

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import elasticflow.checkpoint as ckpt  # noqa: E402
from harness import (MODELS, REPO, final_state, finish, logged_step, members, metrics, start_exact as start,  # noqa: E402
                     train, train_exact as train_ok, train_ok as train_run, wait_for)

final = functools.partial(final_state, rng=False)

GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0
pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(GPUS == 0, reason="no CUDA device: run scripts/ops/gpu_check.sh on a GPU machine")]
CUDA = "trainer.device=cuda"


def _eval(run_dir):
    return [r for r in metrics(run_dir) if "eval_accuracy" in r][-1]


@pytest.mark.parametrize("precision, model, floor", [("bf16", "digits_mlp.py", 0.934), ("16", "digits_cnn.py", 0.918)])
def test_one_worker_trains_on_the_gpu(tmp_path, precision, model, floor):
    proc = train(model, tmp_path, "trainer.epochs=10", CUDA, f"trainer.precision={precision}")
    assert "cuda:0 (" in proc.stderr, proc.stderr[-2000:]  # the banner names the GPU
    assert _eval(tmp_path)["eval_accuracy"] >= floor, _eval(tmp_path)
    saved = ckpt.load(ckpt.latest(tmp_path / "checkpoints"))
    assert all(v.dtype == np.float32 for k, v in saved.items()), "float32 master weights and optimizer state"


def _max_relative_difference(a, b):
    return max(np.linalg.norm(a[n].astype(np.float64) - b[n]) / max(np.linalg.norm(b[n].astype(np.float64)), 1e-12)
               for n in b)


@pytest.mark.parametrize("kind", ["torch_bn", "dict_dropout_torch"])
def test_three_workers_share_the_gpu_one_killed_same_model(tmp_path, kind):
    """Three workers on one GPU (gloo, staged through pinned memory); one dies in the reduction of step
    23: the survivors redo the step and end with the model one worker trains on the GPU."""
    ref, run = tmp_path / "ref", tmp_path / "run"
    train_ok(ref, kind, CUDA)
    train_ok(run, kind, CUDA, "launcher.workers=3", env={"EF_PROBE_KILL": "1:23:reduction"})
    sizes = [r["world_size"] for r in metrics(run) if "loss" in r]
    assert sizes[0] == 3 and sizes[-1] == 2
    diff = _max_relative_difference(final(run), final(ref))
    print(f"{kind}: largest relative difference to one worker {diff:.3g}")
    assert diff <= 1e-5


def test_reproducible_on_the_gpu_three_workers_one_killed_same_bits(tmp_path):
    """trainer.reproducible on the GPU (exact sums on the device, torch's deterministic kernels and cuBLAS's fixed
    workspace): three workers sharing it, one killed in the reduction of step 23, end on one worker's bits."""
    ref, run, mode = tmp_path / "ref", tmp_path / "run", ["trainer.reproducible=true", "optimizer=adamw"]
    train_ok(ref, "torch_bn", CUDA, *mode)
    train_ok(run, "torch_bn", CUDA, *mode, "launcher.workers=3", env={"EF_PROBE_KILL": "1:23:reduction"})
    got, want = final(run), final(ref)
    unequal = [n for n in want if not np.array_equal(got[n], want[n])]
    assert not unequal, f"not one worker's bits: {unequal} (largest relative {_max_relative_difference(got, want):.3g})"


def test_kill_during_training_on_the_gpu_then_resume_on_the_cpu(tmp_path):
    """A worker SIGKILLed at a random point while two train on the GPU; the job finishes, every step
    once; its GPU checkpoint then resumes on the CPU for more steps."""
    run = tmp_path / "run"
    proc = start(run, "torch_bn", CUDA, "launcher.workers=2", "trainer.max_steps=60", "checkpoint.interval.steps=20",
                 env={"EF_PROBE_SLEEP": "0.05"})
    wait_for(lambda: logged_step(run) >= 15, 120, "step 15")
    os.kill(members(run)[1]["pid"], signal.SIGKILL)
    out = finish(proc)
    assert proc.returncode == 0, out[-3000:]
    steps = [r["step"] for r in metrics(run) if "loss" in r]
    assert steps == list(range(1, 61))
    more = start(run, "torch_bn", "trainer.device=cpu", "trainer.max_steps=70")
    out = finish(more)
    assert more.returncode == 0, out[-3000:]
    assert "resumed from" in out and [r["step"] for r in metrics(run) if "loss" in r][-1] == 70


@pytest.mark.skipif(GPUS < 2, reason=f"NCCL recovery needs 2 GPUs or more; this machine has {GPUS}")
def test_nccl_survives_a_dead_peer(tmp_path):
    """comm.backend=nccl, one worker per GPU; one is SIGKILLed while the others may be inside an NCCL
    allreduce: the agent's new generation aborts the communicator and training goes on."""
    run = tmp_path / "run"
    workers = min(GPUS, 4)
    proc = start(run, "torch_bn", CUDA, "comm.backend=nccl", f"launcher.workers={workers}",
                 env={"EF_PROBE_SLEEP": "0.02"})
    wait_for(lambda: logged_step(run) >= 15, 180, "step 15")
    os.kill(members(run)[-1]["pid"], signal.SIGKILL)
    out = finish(proc)
    assert proc.returncode == 0, out[-3000:]
    records = [r for r in metrics(run) if "loss" in r]
    assert [r["step"] for r in records] == list(range(1, records[-1]["step"] + 1))
    assert records[-1]["world_size"] == workers - 1


# An NCCL collective that cannot finish within its timeout (queued behind ~3 s of GPU work, with a 1 s timeout).
# argv: "ours" (distributed/comm/nccl.py's environment) or "torch" (torch's default handling, 3, with its 60 s
# wait for flight-recorder dumps turned off, so that the handling is the one difference).
NCCL_TIMEOUT = r"""
import datetime, os, sys, time
import torch, torch.distributed as dist
from elasticflow.distributed.comm import nccl

ours = sys.argv[1] == "ours"
if ours:
    nccl.environment()
else:
    os.environ.update(TORCH_NCCL_ASYNC_ERROR_HANDLING="3", TORCH_NCCL_DUMP_ON_TIMEOUT="0",
                      TORCH_NCCL_WAIT_TIMEOUT_DUMP_MILSEC="0")
torch.cuda.set_device(0)
store = dist.HashStore()
pg = dist.ProcessGroupNCCL(dist.PrefixStore("gen1/", store), 0, 1, nccl.options(1.0))
pg.eager_connect_single_device(torch.device("cuda:0"))
t = torch.ones(1 << 16, device="cuda")
nccl.finish(pg.allreduce([t]), t.device, 30.0, lambda: False)
torch.cuda._sleep(6_000_000_000)  # GPU cycles: ~3 s at 2 GHz; the NCCL stream waits for them
work = pg.allreduce([t])
try:
    nccl.finish(work, t.device, 1.0, lambda: False)
    print("completed", flush=True)
except Exception as exc:
    print("raised", type(exc).__name__, str(exc).splitlines()[0][:200], flush=True)
torch.cuda.synchronize()
pg2 = dist.ProcessGroupNCCL(dist.PrefixStore("gen2/", store), 0, 1, nccl.options(30.0))  # the next generation
t2 = torch.full((4,), 2.0, device="cuda")
nccl.finish(pg2.allreduce([t2]), t2.device, 30.0, lambda: False)
print("recovered", float(t2.sum()), flush=True)
time.sleep(3)  # the watchdog saw the timeout as well: it must not end the process meanwhile
print("alive", flush=True)
os._exit(0)
"""


def test_a_timed_out_nccl_collective_raises_and_the_process_goes_on():
    """distributed/comm/nccl.py on a GPU: with the worker's NCCL environment a collective past its timeout raises
    into the caller, the process builds the next generation's group and lives on; torch's default handling ends
    the process instead (what recovery could not survive). One GPU: a world of one, the timeout forced by queuing
    the collective behind a long kernel."""
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    for name in ("TORCH_NCCL_ASYNC_ERROR_HANDLING", "TORCH_NCCL_DUMP_ON_TIMEOUT", "TORCH_NCCL_WAIT_TIMEOUT_DUMP_MILSEC"):
        env.pop(name, None)
    ours = subprocess.run([sys.executable, "-c", NCCL_TIMEOUT, "ours"], env=env, capture_output=True, text=True,
                          timeout=180)
    lines = ours.stdout.splitlines()
    assert ours.returncode == 0 and len(lines) == 3, ours.stdout + ours.stderr[-3000:]
    # torch's text: the wait's own timeout, or the watchdog's abort where it got there first (both ~1 s)
    assert lines[0].startswith("raised"), lines
    assert lines[1:] == ["recovered 8.0", "alive"], lines
    default = subprocess.run([sys.executable, "-c", NCCL_TIMEOUT, "torch"], env=env, capture_output=True, text=True,
                             timeout=180)
    print("torch's default handling:", default.returncode, default.stdout.splitlines())
    assert default.returncode != 0 and "alive" not in default.stdout, default.stdout + default.stderr[-2000:]


# ---------------------------------------------------------------- sharded state on the GPU (issue #46)
UNITS = MODELS.parent / "tests" / "models" / "units_probe.py"
# 2048 wide: the block's weights span whole 2 MiB granules, which stage 3 unmaps and maps again
UNIT_ARGS = ["trainer.micro_batch_size=8", "+model_args.hidden=2048", "optimizer.momentum=0.9", "optimizer.lr=0.02",
             "trainer.max_steps=24", "checkpoint.interval.steps=10", CUDA]


def test_a_gpu_vector_gives_granules_back_and_maps_them_again_as_zeros():
    """backends/torch/device_pages.py: CUDA's virtual memory, a granule at a time (what the CPU suite's strict
    pages stand in for)."""
    from elasticflow.backends.torch.device_pages import DeviceVector

    v = DeviceVector(64 << 20 >> 2, torch.device("cuda"))  # 64 MiB
    free_before = torch.cuda.mem_get_info()[0]
    v.tensor.fill_(1.0)
    assert v.resident_bytes() == v.size
    given = v.drop(1000, v.n - 1000)
    assert given >= v.size - 2 * v.granule and v.resident_bytes() == v.size - given
    assert torch.cuda.mem_get_info()[0] >= free_before + given - v.granule  # the device got them back
    v.ensure(0, v.n)
    assert float(v.tensor[:1000].sum()) == 1000.0 and float(v.tensor[v.n - 1000:].sum()) == 1000.0
    assert float(v.tensor[1000:v.n - 1000].abs().sum()) == 0.0
    version = v.tensor._version
    v.alias[5:9].fill_(3.0)
    assert v.tensor._version == version and float(v.tensor[5]) == 3.0


def test_a_gpu_vector_built_on_a_fresh_thread_and_a_failed_map_keeps_no_memory(monkeypatch):
    """device_pages.py's context and failure paths on the real driver: a vector built on a thread that never touched
    the GPU (no current context there) works; one whose 50th granule fails to map gives every granule back at
    once (the error's traceback still holds the vector's reservation), including the failed granule's memory."""
    from elasticflow.backends.torch import device_pages
    from elasticflow.errors import ElasticFlowError

    built = {}

    def build():
        try:
            built["vector"] = device_pages.DeviceVector(16 << 20 >> 2, torch.device("cuda", 0))
            built["vector"].tensor.fill_(2.0)
            built["sum"] = float(built["vector"].tensor.sum())
        except Exception as exc:  # noqa: BLE001 - reported below
            built["error"] = exc

    thread = threading.Thread(target=build)
    thread.start()
    thread.join(120)
    assert "error" not in built and built["sum"] == 2.0 * (16 << 20 >> 2), built
    del built["vector"]

    real, calls = device_pages._cuda(), {"map": 0}

    class FailingMap:
        def __getattr__(self, name):
            return getattr(real, name)

        def cuMemMap(self, *args):
            calls["map"] += 1
            return 2 if calls["map"] == 50 else real.cuMemMap(*args)  # CUDA_ERROR_OUT_OF_MEMORY

    torch.cuda.synchronize()
    free = torch.cuda.mem_get_info()[0]
    monkeypatch.setattr(device_pages, "_driver", FailingMap())
    with pytest.raises(ElasticFlowError, match="cuMemMap failed") as err:
        device_pages.DeviceVector(256 << 20 >> 2, torch.device("cuda", 0))
    monkeypatch.setattr(device_pages, "_driver", real)
    torch.cuda.synchronize()
    kept = free - torch.cuda.mem_get_info()[0]
    assert err.value is not None and kept <= 2 * (2 << 20), f"{kept} bytes kept after the failed build"


@pytest.mark.parametrize("stage", ["optimizer", "gradients", "parameters"])
def test_sharded_state_on_the_gpu_three_workers_one_killed_same_model(tmp_path, stage):
    """trainer.shard on a GPU (the slices, the update and, for stage 3, the flat vectors in CUDA's virtual memory):
    three workers sharing it (gloo: their GPU tensors staged through the host), one SIGKILLed as a unit's
    gradient goes to its owners; the survivors redo the step from the buddy copies and end on one worker's model."""
    ref, run = tmp_path / "ref", tmp_path / "run"
    train_run(ref, *UNIT_ARGS, model=UNITS)
    train_run(run, *UNIT_ARGS, f"trainer.shard={stage}", "launcher.workers=3", model=UNITS,
              env={"EF_UNITS_KILL": "1:9:reduce" if stage == "parameters" else "1:9:update"})
    assert [r["world_size"] for r in metrics(run) if "loss" in r][-1] == 2
    diff = _max_relative_difference(final(run), final(ref))
    print(f"shard={stage} on the GPU: largest relative difference to one worker {diff:.3g}")
    assert diff <= 1e-5


def test_stage_3_reproducible_on_the_gpu_one_killed_same_bits(tmp_path):
    """trainer.reproducible with stage 3 on the GPU: the owners' exact sums on the device; after the kill the 2
    survivors each hold everything, and the whole gradient is summed exactly (mapped again after each micro-batch's
    zero_grad gave it back). Same bits as one worker."""
    mode = ["trainer.reproducible=true", "trainer.shard=parameters", "optimizer=adamw", "optimizer.lr=0.003",
            "trainer.grad_clip=0.5"]
    ref, run = tmp_path / "ref", tmp_path / "run"
    train_run(ref, *UNIT_ARGS, *mode, model=UNITS)
    train_run(run, *UNIT_ARGS, *mode, "launcher.workers=3", model=UNITS, env={"EF_UNITS_KILL": "1:9:reduce:3"})
    got, want = final(run), final(ref)
    unequal = [n for n in want if not np.array_equal(got[n], want[n])]
    assert not unequal, f"not one worker's bits: {unequal} (largest relative {_max_relative_difference(got, want):.3g})"


@pytest.mark.skipif(GPUS < 2, reason=f"NCCL needs a GPU per worker; this machine has {GPUS}")
def test_stage_3_over_nccl_survives_a_kill_in_a_units_fetch(tmp_path):
    """comm.backend=nccl, one worker per GPU: units come in by NCCL's point to point, gradients go to their owners
    the same way. One worker SIGKILLed as it fetches a unit in forward: the survivors end on one worker's model."""
    workers = min(GPUS, 4)
    ref, run = tmp_path / "ref", tmp_path / "run"
    train_run(ref, *UNIT_ARGS, model=UNITS)
    train_run(run, *UNIT_ARGS, "trainer.shard=parameters", "comm.backend=nccl", f"launcher.workers={workers}",
              model=UNITS, env={"EF_UNITS_KILL": f"{workers - 1}:9:forward_fetch"})
    diff = _max_relative_difference(final(run), final(ref))
    print(f"shard=parameters over NCCL, {workers} GPUs: largest relative difference to one worker {diff:.3g}")
    assert diff <= 1e-5
