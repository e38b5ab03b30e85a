"""The controller and what it plans, checks and reports: opd_trainer (setup / train / finish), plan,
preflight, validation, metrics, run_report, resume_check. Imports workers, verl_compat, models, utils."""
