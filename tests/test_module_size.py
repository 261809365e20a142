"""No module under elasticflow/ over 500 lines: past that a module holds more than one subject, and a reader
cannot keep it in view. Split it along a seam into a module of its own (as distributed/agent/workers_json.py came
out of agent.py), rather than squeezing lines."""
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
MAX_LINES = 500


def test_no_module_over_500_lines():
    sizes = {path.relative_to(REPO).as_posix(): len(path.read_text().splitlines())
             for path in sorted((REPO / "elasticflow").rglob("*.py"))}
    assert len(sizes) > 20, "found no modules under elasticflow/"
    over = [f"{path}: {n} lines" for path, n in sizes.items() if n > MAX_LINES]
    assert not over, f"modules over {MAX_LINES} lines (split each along a seam):\n  " + "\n  ".join(over)
