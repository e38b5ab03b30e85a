"""miniverl: a single-GPU miniature of verl v0.8.0's on-policy distillation."""

__version__ = "0.1.0.dev0"

# The verl release whose semantics (config keys, metric names, losses) miniverl follows.
VERL_TAG = "v0.8.0"
VERL_COMMIT = "7aed6b230776f963fa09509c10d9c3a767d1102c"
VERL_REPOSITORY = "https://github.com/verl-project/verl"
