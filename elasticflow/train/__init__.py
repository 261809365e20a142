"""The trainer's parts, each on its own: the run's build (``builder``), one optimizer step (``stepper``) or a
round of local SGD / DiLoCo (``local_sgd``), membership changes (``regroup``), the replicated progress
(``state``), evaluation, the update's checks (``grad_check``, ``loss_scale``), the model file's contract
(``model_file``), what draws random numbers (``randomness``) and the backend-neutral ops a model file calls
(``ops``, public as ``elasticflow.ops``). The loop itself is ``elasticflow/trainer.py``."""
