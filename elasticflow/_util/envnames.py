"""The environment variables ElasticFlow's processes pass each other, by name.

A leaf (it imports nothing): the agent sets most of them for the workers it starts (``distributed/``),
``devices`` reads the local slot, the CLI and ``exits`` the debug flag. ``distributed.protocol``
re-exports them with the rest of what the agent and the workers say to each other.
"""

ENV_STORE = "ELASTICFLOW_STORE"            # host:port of the agent's TCPStore
ENV_WORKER_ID = "ELASTICFLOW_WORKER_ID"    # the id the agent assigned when it spawned this worker
ENV_RUN_DIR = "ELASTICFLOW_RUN_DIR"
ENV_RUN_DIR_ID = "ELASTICFLOW_RUN_DIR_ID"  # "st_dev:st_ino" of the run directory the agent checked ("*:st_ino": srun's, any host)
ENV_LOCAL_WORKERS = "ELASTICFLOW_LOCAL_WORKERS"
ENV_TOKEN = "ELASTICFLOW_TOKEN"
ENV_BIND = "ELASTICFLOW_BIND"              # the address gloo listens on ("auto": see launchers/worker.bind_address)
ENV_SPAWNED_AT = "ELASTICFLOW_SPAWNED_AT"  # time.time() when the agent started the worker (start-up cost)
ENV_LOCAL_SLOT = "ELASTICFLOW_LOCAL_SLOT"    # the worker's slot on its host: which GPU it binds (devices.py)
ENV_NODE = "ELASTICFLOW_NODE"              # the node agent that started the worker (launcher=nodes): its host's name
ENV_JOB_TOKEN = "ELASTICFLOW_JOB_TOKEN"    # launcher=nodes: the job's shared secret, as users pass secrets
ENV_DEBUG = "ELASTICFLOW_DEBUG"            # "1": tracebacks, not one line; set by `--debug`, inherited by children
