"""tests/models/digits_probe.py (its EF_PROBE_* fault injection) with the digits' held-out split as eval_data:
a run with evaluations, a best checkpoint and early stopping to kill (scripts/tools/docs_figure.sh's figure)."""
import digits_probe
from digits_probe import data, forward, model  # noqa: F401 - the model file's functions, as the probe's

eval_data = digits_probe.digits_mlp.eval_data
