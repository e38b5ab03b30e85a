"""miniverl: a single-GPU miniature of verl v0.8.0's on-policy distillation."""

import logging
import time
from pathlib import Path

__version__ = "0.1.0.dev0"

# The report's clocks (cold start, time to first rollout, ...) start here: `python -m miniverl.main`
# imports this package first, right after the interpreter's own start-up, whatever ran before the
# interpreter in the same shell command (a pip install) or in the same process (bash's exec).
STARTED_AT = time.time()

# The folder that holds conf/ (the Hydra config tree) and data/ (the prompts miniverl ships): the clone
# this package is installed from (`pip install -e .`).
CHECKOUT = Path(__file__).resolve().parent.parent

# The verl release whose semantics (config keys, metric names, losses) miniverl follows.
VERL_TAG = "v0.8.0"
VERL_COMMIT = "7aed6b230776f963fa09509c10d9c3a767d1102c"
VERL_REPOSITORY = "https://github.com/verl-project/verl"

# bitsandbytes logs a warning when it is imported without the optional `kernels` package ("Failed
# to load CPU gemm_4bit_forward from kernels-community"), and `kernels` (a dependency of transformers
# since 5.25) one when the hub is offline ("Skipping publisher trust check"): nothing a user can act
# on, so both are silenced here, before any module imports bitsandbytes (peft and transformers do).
logging.getLogger("bitsandbytes").setLevel(logging.ERROR)
logging.getLogger("kernels").setLevel(logging.ERROR)
