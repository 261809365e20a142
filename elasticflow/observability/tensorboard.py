"""RUN_DIR/tensorboard/: the run's scalars and membership events, for TensorBoard.

A sidecar process follows the run's own records, metrics.jsonl (steps and evaluations) and
events.jsonl (the agent's and the workers' membership events, as text entries), and writes them with
the ``tensorboard`` package's own ``EventFileWriter`` and protos (no torch or TF summary API, so both
backends log alike). Not a thread of the trainer: TensorBoard's record checksum is pure Python
without TensorFlow (~55 us an event), and a thread would take that from the step through the GIL.
The training thread pays nothing beyond the metrics.jsonl line it writes anyway.

Rank 0 starts the sidecar (``TensorBoard.start``); it remembers how far it read (tensorboard/.read),
so a worker that becomes rank 0 starts one that goes on from there, and it drains and exits when its
stdin closes (``close``, or the trainer's death).

    python -m elasticflow.observability.tensorboard RUN_DIR --parent PID     # what start() runs
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import threading
import time
import types
from pathlib import Path
from typing import Any, Dict, Optional

from .._util import untrusted

POLL_S = 0.5  # how often the sidecar looks for new lines
NICE = 10     # the sidecar's scheduling priority, below the trainer's
OFFSETS = ".read"  # tensorboard/.read: bytes of metrics.jsonl and events.jsonl already written as events

# The record keys of metrics.jsonl that are not scalars worth a chart (or are charted under another name).
_NOT_CHARTED = {"step", "epoch", "samples_seen", "time", "micro_step", "global_batch", "step_time_s", "world_size",
                "generation", "skipped", "overflow", "train_s"}  # train_s: the goodput ledger's (goodput.py)


def scalars_of(record: Dict[str, Any]) -> Dict[str, float]:
    """A metrics.jsonl record as TensorBoard tags and values (``eval_*`` keys go under ``eval/``)."""
    if "loss" not in record:
        return {k.replace("eval_", "eval/", 1): float(v) for k, v in record.items()
                if k.startswith("eval_") and isinstance(v, (int, float))}
    out = {f"train/{k}": float(v) for k, v in record.items()
           if k not in _NOT_CHARTED and isinstance(v, (int, float)) and not isinstance(v, bool)}
    if "step_time_s" in record:
        out["speed/step_time_s"] = float(record["step_time_s"])
        out["speed/samples_per_s"] = record.get("global_batch", 0) / max(float(record["step_time_s"]), 1e-9)
    for k in ("world_size", "generation"):
        if k in record:
            out[f"elastic/{k}"] = float(record[k])
    out["train/skipped"] = 1.0 if record.get("skipped") else 0.0
    for worker, mib in (record.get("memory_mib") or {}).items():
        out[f"memory/worker_{worker}_mib"] = float(mib)  # resident memory of each worker, by worker id
    return out


class TensorBoard:
    """The trainer's handle on the sidecar: ``start`` once (rank 0), ``close`` at the end."""

    def __init__(self, run_dir: Path):
        self.run_dir = Path(run_dir)
        self.proc: Optional[subprocess.Popen] = None

    def start(self) -> None:
        if self.proc is None:
            # Its stdin is the stop request: closed by close(), or by the kernel when this process dies.
            # (Not a signal: one sent while the sidecar is still starting would kill it before it wrote.)
            self.proc = subprocess.Popen([sys.executable, "-m", "elasticflow.observability.tensorboard", str(self.run_dir),
                                          "--parent", str(os.getpid())], stdin=subprocess.PIPE)

    def close(self, timeout_s: float = 15.0) -> None:
        """Let the sidecar write what is left and exit (bounded: a stuck disk does not hold the exit)."""
        if self.proc is None:
            return
        self.proc.stdin.close()
        try:
            self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.proc = None


# ---------------------------------------------------------------------------------------------- sidecar
class _Follower:
    """Turns new complete lines of metrics.jsonl and events.jsonl into events."""

    def __init__(self, run_dir: Path):
        self.run_dir = run_dir
        self.dir = run_dir / "tensorboard"
        self.dir.mkdir(parents=True, exist_ok=True)
        try:
            self.read = json.loads((self.dir / OFFSETS).read_text())
        except (OSError, ValueError):
            self.read = {"metrics": 0, "events": 0}
        self.step = 0
        # Without this module TensorBoard imports TensorFlow for its file API (2-3 s, ~500 MB) in a torch run.
        if "tensorflow" not in sys.modules:
            sys.modules.setdefault("tensorboard.compat.notf", types.ModuleType("tensorboard.compat.notf"))
        from tensorboard.summary.writer.event_file_writer import EventFileWriter

        self.writer = EventFileWriter(str(self.dir), filename_suffix=f".{os.getpid()}")

    def poll(self) -> None:
        for record in self._new_lines("metrics"):
            try:  # a crafted line (text where a figure belongs) is skipped, never the end of the sidecar
                step, wall, values = int(record.get("step", self.step)), _wall(record), scalars_of(record)
            except (TypeError, ValueError, OverflowError):
                continue
            self.step = step
            if values:
                self.writer.add_event(_scalar_event(self.step, values, wall))
        for event in self._new_lines("events"):
            kind = str(event.get("event", "event"))
            text = ", ".join(f"{k}={v}" for k, v in event.items() if k not in ("event", "time"))
            try:
                wall = _wall(event)
            except (TypeError, ValueError, OverflowError):
                continue
            self.writer.add_event(_text_event(self.step, f"events/{kind}", f"{kind}: {text}", wall))
        self.writer.flush()
        _atomic_write(self.dir / OFFSETS, json.dumps(self.read))

    def _new_lines(self, name: str):
        path = self.run_dir / f"{name}.jsonl"
        try:
            size = path.stat().st_size
        except FileNotFoundError:
            return []
        if size <= self.read[name]:
            return []
        with open(path, "rb") as f:
            f.seek(self.read[name])
            chunk = f.read(size - self.read[name])
        complete = chunk[:chunk.rfind(b"\n") + 1]  # a line still being appended waits for the next poll
        self.read[name] += len(complete)
        records = []
        for line in complete.decode(errors="replace").splitlines():
            try:
                record = untrusted.loads(line, max_bytes=1 << 20)  # bounded: a crafted line is no parser bomb
            except ValueError:  # a torn line of a killed writer, or a crafted one
                continue
            if isinstance(record, dict):
                records.append(record)
        return records


def _wall(record: Dict[str, Any]) -> float:
    wall = float(record.get("time", time.time()))
    if not 0 < wall < 1e11:
        raise ValueError(f"{wall} is no Unix time")
    return wall


def _atomic_write(path: Path, text: str) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def _scalar_event(step: int, values: Dict[str, float], wall: float):
    from tensorboard.compat.proto import event_pb2, summary_pb2

    summary = summary_pb2.Summary(value=[summary_pb2.Summary.Value(tag=k, simple_value=v) for k, v in values.items()])
    return event_pb2.Event(wall_time=wall, step=step, summary=summary)


def _text_event(step: int, tag: str, text: str, wall: float):
    from tensorboard.compat.proto import event_pb2, summary_pb2, tensor_pb2, tensor_shape_pb2, types_pb2

    # The text plugin's format: a string tensor with the plugin named in the metadata.
    meta = summary_pb2.SummaryMetadata(plugin_data=summary_pb2.SummaryMetadata.PluginData(plugin_name="text"))
    tensor = tensor_pb2.TensorProto(dtype=types_pb2.DT_STRING, string_val=[text.encode()],
                                    tensor_shape=tensor_shape_pb2.TensorShapeProto(
                                        dim=[tensor_shape_pb2.TensorShapeProto.Dim(size=1)]))
    summary = summary_pb2.Summary(value=[summary_pb2.Summary.Value(tag=tag, metadata=meta, tensor=tensor)])
    return event_pb2.Event(wall_time=wall, step=step, summary=summary)


def _until_eof(stop: threading.Event) -> None:
    """Set ``stop`` when the trainer closes our stdin. Raw reads of fd 0, not sys.stdin.buffer: a daemon
    thread blocked in the buffered reader holds its lock, and an exit of ours while the trainer still
    runs (its run directory removed) would then abort at interpreter shutdown."""
    while os.read(0, 4096):
        pass
    stop.set()


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description="Follow a run's metrics and events into RUN_DIR/tensorboard/.")
    p.add_argument("run_dir", type=Path)
    p.add_argument("--parent", type=int, required=True, help="exit (after a last drain) when this pid is gone")
    args = p.parse_args(argv)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the trainer's; it closes our stdin when done
    # A follower: it may lag, the workers may not. Where they use every core (2 workers on 2 cores), its
    # checksums (pure Python, ~0.08 ms of CPU per logged step) took their time slices at normal priority.
    os.nice(NICE)
    stop = threading.Event()
    threading.Thread(target=_until_eof, args=(stop,), daemon=True).start()
    try:
        follower = _Follower(args.run_dir)
    except ImportError:
        print("warning: tensorboard is not installed; RUN_DIR/tensorboard is not written "
              "(pip install tensorboard, or pass trainer.tensorboard=false)", file=sys.stderr)
        return
    try:
        while os.getppid() == args.parent:
            follower.poll()
            if stop.wait(POLL_S):
                break
        follower.poll()  # the last lines, written before the trainer asked us to stop
    except FileNotFoundError:
        if args.run_dir.is_dir():
            raise
        return  # the run directory was removed under us (a temporary one): nothing left to follow
    finally:
        try:
            follower.writer.close()
        except OSError:
            pass


if __name__ == "__main__":
    main()
