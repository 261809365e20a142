"""The reproducible sums in isolation (``elasticflow/replica/exact_sum.py``): what each phase of a step's sum
costs against its float32 counterpart, with no model around it, so the figures hold still on a busy machine.

W worker processes (a real gloo ``Group`` over loopback) each hold a gradient of N float32 elements and run,
alternating within every round (medians over rounds):

- deposit: K micro-batches' gradients added to the exact sums, against K plain float32 ``add_`` of the same
  tensors (what autograd's accumulation costs);
- reduce: the members' sums (``ReproducibleSum.allreduce``: the windows' MAX, then the SUM on the wire it
  chooses) and their values written back as a float32 gradient, against one float32 allreduce;
- step: both, against both float32 counterparts: the sums' share of a step's time beyond the default's.

``--base DIR`` also times another tree's ``exact_sum.py`` (a ``git worktree`` of an earlier commit) on the same
data in the same rounds, and prints new over base. Bytes on the wire per element are stated for each form.

    .venv/bin/python scripts/bench/bench_exact_sum.py                          # 2.19M elements (GPT-style), W=2
    .venv/bin/python scripts/bench/bench_exact_sum.py --workers 1 2 4 --n 310000 --k 4
    git worktree add /tmp/base HEAD~1 && .venv/bin/python scripts/bench/bench_exact_sum.py --base /tmp/base
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def load_sums(tree: Path, name: str):
    """``tree``'s ``elasticflow/replica/exact_sum.py`` as module ``name`` (its relative imports from this tree's
    package: only ``..errors``, the same in both)."""
    import elasticflow.replica  # noqa: F401 - the package its relative import resolves in

    spec = importlib.util.spec_from_file_location(f"elasticflow.replica.{name}",
                                                  tree / "elasticflow/replica/exact_sum.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    if hasattr(module, "_Kernels"):  # a tree from before sum_kernels.py: its kernels in the same file
        compiled = module
    else:
        from elasticflow.replica import sum_kernels as compiled
    kernels = compiled._Kernels
    kernels.folder().mkdir(parents=True, exist_ok=True)
    # Built once per machine, in a process of its own as a run's builder does (the kernels a run would load)
    code = f"import sys; sys.path.insert(0, {str(tree)!r}); import importlib.util as u; " \
           f"s = u.spec_from_file_location('elasticflow.replica.bench_build', {compiled.__file__!r}); " \
           f"m = u.module_from_spec(s); sys.modules[s.name] = m; s.loader.exec_module(m); " \
           f"from pathlib import Path; m.build(Path({str(kernels.folder())!r}), {kernels.key()!r})"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=1800, cwd=REPO)
    return module


def member(rank: int, world: int, port: int, args: argparse.Namespace) -> None:
    import torch
    from torch.distributed import TCPStore

    from elasticflow.distributed.comm.comm import Group

    torch.set_num_threads(1)
    arms = {"new": load_sums(REPO, "exact_sum_bench_new")}
    if args.base:
        arms["base"] = load_sums(Path(args.base), "exact_sum_bench_base")
    store = TCPStore("127.0.0.1", port, world, rank == 0, wait_for_workers=False)
    group = Group(store, 0, rank, world, timeout_s=300) if world > 1 else None
    g = torch.Generator().manual_seed(rank)
    grads = [torch.randn(args.n, generator=g) * torch.exp2(torch.randint(-20, 4, (args.n,), generator=g).float())
             for _ in range(args.k)]
    grad, times = torch.zeros(args.n), {}

    def timed(key: str, fn) -> None:
        if group is not None:
            group.allreduce_(torch.zeros(1))  # start together
        start = time.perf_counter()
        fn()
        times.setdefault(key, []).append(time.perf_counter() - start)

    def float32_deposit() -> None:
        grad.zero_()
        for t in grads:
            grad.add_(t)

    def float32_reduce() -> None:
        if group is not None:
            group.allreduce_(grad)

    sums = {name: m.ReproducibleSum(args.n) for name, m in arms.items()}

    def exact_deposit(name: str):
        def run() -> None:
            acc = sums[name]
            acc.clear()
            add = getattr(acc, "add_later", acc.add)  # as a step adds its micro-batches' gradients
            for t in grads:
                add(t)
            if hasattr(acc, "flush"):
                acc.flush()
        return run

    def exact_reduce(name: str):
        def run() -> None:
            acc = sums[name]
            if group is not None:
                acc.allreduce(group)
            if hasattr(acc, "values_into"):  # one pass into the float32 gradient, as a step reads it
                acc.values_into(grad)
            else:  # an older tree: its float64 values, then the copy its step made
                grad.copy_(acc.values())
        return run

    for r in range(args.rounds + 1):  # round 0 warms up (kernels load, buffers allocate)
        order = [("float32", float32_deposit, float32_reduce)] + \
            [(name, exact_deposit(name), exact_reduce(name)) for name in arms]
        for name, deposit, reduce in (order if r % 2 else order[::-1]):
            timed(f"{name}/deposit", deposit)
            timed(f"{name}/reduce", reduce)
        if r == 0:
            times.clear()
    if rank == 0:
        print(json.dumps({k: statistics.median(v) for k, v in times.items()}))
    if group is not None:
        group.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", nargs="+", type=int, default=[2])
    parser.add_argument("--n", type=int, default=2_190_000, help="gradient elements (GPT-style: 2.19M)")
    parser.add_argument("--k", type=int, default=2, help="micro-batches per worker per step")
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--base", help="another tree whose exact_sum.py to time beside this one's")
    parser.add_argument("--member", nargs=3, type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.member:
        member(*args.member, args)
        return
    arms = ["new"] + (["base"] if args.base else [])
    print(f"| workers | phase | float32 ms | {' | '.join(f'{a} ms | {a} / float32' for a in arms)}"
          f"{' | new / base' if args.base else ''} |")
    print("|---|---|---|" + "---|---|" * len(arms) + ("---|" if args.base else ""))
    for world in args.workers:
        port = 29000 + os.getpid() % 1000 + world
        cmd = [sys.executable, __file__, "--n", str(args.n), "--k", str(args.k), "--rounds", str(args.rounds)]
        if args.base:
            cmd += ["--base", args.base]
        procs = [subprocess.Popen(cmd + ["--member", str(r), str(world), str(port)], stdout=subprocess.PIPE,
                                  text=True, cwd=REPO) for r in range(world)]
        out = [p.communicate(timeout=1800)[0] for p in procs]
        if any(p.returncode for p in procs):
            sys.exit(f"a member failed (exit codes {[p.returncode for p in procs]})")
        got = json.loads(out[0].strip().splitlines()[-1])
        for phase in ("deposit", "reduce", "step"):
            def ms(arm: str) -> float:
                if phase == "step":
                    return 1e3 * (got[f"{arm}/deposit"] + got[f"{arm}/reduce"])
                return 1e3 * got[f"{arm}/{phase}"]
            cells = " | ".join(f"{ms(a):.2f} | {ms(a) / ms('float32'):.2f}x" for a in arms)
            tail = f" | **{ms('new') / ms('base'):.2f}x**" if args.base else ""
            print(f"| {world} | {phase} | {ms('float32'):.2f} | {cells}{tail} |", flush=True)
    print(f"\nbytes on the wire per element: float32 4; reproducible 9 (an int8 window's MAX, one int64 SUM) while "
          f"the sum's terms are at most 2^11, else 17 (both int64 bins); n={args.n:,}, k={args.k} micro-batches "
          f"per worker, medians of {args.rounds} rounds")


if __name__ == "__main__":
    main()
