"""What a Hydra sweep (`-m`) plans and is refused for before it starts: its jobs as Hydra's basic
sweeper numbers them, the keys that only say how a command runs, and SweepPreflight, the callback
that checks the sweep's folder and every job's config before Hydra writes anything."""

from __future__ import annotations

import logging
import sys
from pathlib import Path

from hydra.experimental.callback import Callback
from omegaconf import DictConfig, OmegaConf

from miniverl.config import ENTRY_VERL_HINTS
from miniverl.utils.errors import MiniverlError
from miniverl.utils.hydra_entry import (
    SWEEP_DIR,
    SWEEP_LOCK,
    as_typed,
    config_flags,
    hydra_error_line,
    refuse_an_empty_folder,
)
from miniverl.utils.overrides import override_key


class SweepPreflight(Callback):
    """What a sweep is refused for before Hydra writes anything (its multirun.yaml, each job's
    .hydra/), in one line: the SLURM launcher on a machine without SLURM, a subdir that names one
    folder for every job, a folder that holds another sweep's runs (the same sweep command goes on
    there instead: a finished job is kept, a stopped one resumes in its folder: miniverl.main) or a
    shuffle() sweep's, a sweep of no jobs, and a job whose config would not compose or validate.
    Hydra turns a callback's exceptions into warnings and goes on (HYDRA_FULL_ERROR=1 too): only
    SystemExit stops the sweep here."""

    def on_multirun_start(self, config: DictConfig, **kwargs) -> None:
        refuse_an_empty_folder(config, "hydra.sweep.dir")
        refusal = (
            self.slurm_missing(config)
            or self.shared_job_folder(config)
            or self.in_use(config)  # before another_sweep says what the sweep keeps there
            or self.another_sweep(config)
            or self.invalid_jobs(config)
        )
        if refusal:
            print(f"miniverl: error: {refusal}", file=sys.stderr)
            raise SystemExit(2)
        SWEEP_DIR[:] = [Path(config.hydra.sweep.dir)]  # a Ctrl-C between two jobs says how to go on in it

    @staticmethod
    def in_use(config: DictConfig) -> str | None:
        """The sweep folder, locked for as long as this command runs (hydra_entry closes SWEEP_LOCK): the same
        sweep started twice would run each job in one process and have the other refused in the folder it
        holds, so that both listed every job as failed."""
        from miniverl.utils.run_folder import flock_folder  # torch and peft: the jobs import them anyway

        sweep_dir = Path(config.hydra.sweep.dir)
        made = None if sweep_dir.is_dir() else sweep_dir  # removed again if the sweep is refused (hydra_entry)
        try:
            sweep_dir.mkdir(parents=True, exist_ok=True)
            descriptor = flock_folder(sweep_dir)
        except BlockingIOError:
            return (
                f"hydra.sweep.dir={sweep_dir} is in use: another sweep is running there now; wait until it ends, "
                "then run the same command again (finished jobs are kept, stopped ones resume), or choose another "
                "hydra.sweep.dir"
            )
        except OSError:  # a folder that cannot be made: Hydra's own attempt says so, in one line
            return None
        SWEEP_LOCK.extend([(descriptor, made)] if descriptor is not None else [])
        return None

    @staticmethod
    def shared_job_folder(config: DictConfig) -> str | None:
        """A hydra.sweep.subdir that names one folder for every job (`x`, or empty: the sweep folder): the
        second job would find the first one's run there and be refused, or resume it as its own."""
        subdir = str(OmegaConf.to_container(config.hydra.sweep, resolve=False).get("subdir") or "")
        if any(per_job in subdir for per_job in ("hydra.job.num", "hydra.job.id", "hydra.job.override_dirname")):
            return None
        jobs = each_job(sweep_arguments(config.hydra))
        if jobs is not None and len(jobs) < 2:
            return None
        named = subdir or "''"
        return (
            f"hydra.sweep.subdir={named} names the same folder for every job of the sweep: each job needs its own; "
            "leave it out (${hydra.job.num}) or make it name the job (${hydra.job.override_dirname})"
        )

    @staticmethod
    def slurm_missing(config: DictConfig) -> str | None:
        import shutil

        if "SlurmLauncher" not in str(OmegaConf.select(config, "hydra.launcher._target_") or ""):
            return None
        if shutil.which("sbatch") and shutil.which("srun"):
            return None
        return (
            "hydra/launcher=slurm submits to SLURM, and this machine has no sbatch/srun: run the sweep on a SLURM "
            "login node, or here without hydra/launcher=slurm (hydra/launcher=parallel runs the jobs side by side)"
        )

    @staticmethod
    def invalid_jobs(config: DictConfig) -> str | None:
        """Every job composed and validated as it will run, and its data files found, before the first
        one starts: a value refused in the last job of a sweep is found now, not after the jobs before
        it have run (Hydra itself composes the jobs only after writing multirun.yaml, and validates none)."""
        from hydra.core.global_hydra import GlobalHydra
        from hydra.errors import CompactHydraException

        from miniverl.config import to_config
        from miniverl.utils.dataset import missing_data_file

        basic = "BasicSweeper" in str(OmegaConf.select(config, "hydra.sweeper._target_") or "")
        jobs = each_job(sweep_arguments(config.hydra)) if basic else None  # another sweeper picks its own jobs
        if jobs is None or not GlobalHydra.instance().is_initialized():  # glob()/shuffle(): each job checks itself
            return None
        if not jobs:  # range(3,1): Hydra would launch none, and the command say nothing of it
            from hydra.core.override_parser.overrides_parser import OverridesParser

            arguments = sweep_arguments(config.hydra)
            parsed = OverridesParser.create().parse_overrides(arguments)
            swept = [text for text, o in zip(arguments, parsed) if o.is_sweep_override()] or arguments
            return f"the sweep has no jobs: {' '.join(swept)} expands to none"
        if len(jobs) > 20:
            logging.getLogger("miniverl").info("checking the config of each of the sweep's %d jobs", len(jobs))
        loader = GlobalHydra.instance().config_loader()
        shared = set.intersection(*(set(job) for job in jobs))
        refused = []
        for num, job in enumerate(jobs):
            swept = " ".join(o for o in job if o not in shared)  # what names the job: its swept values
            name = f"job {num} ({swept})" if swept else f"job {num}"
            try:
                checked = to_config(loader.load_sweep_config(config, list(job)))
                if missing := missing_data_file(checked.data, ("train_files", "val_files")):  # the rest: the job's
                    raise MiniverlError(missing)
            except CompactHydraException as error:
                refused.append(f"{name}: {hydra_error_line(error, *ENTRY_VERL_HINTS[:1])}")
            except MiniverlError as error:
                refused.append(f"{name}: {error}")
            except Exception:  # anything else is the job's to report as it runs, as without this check
                continue
        if not refused:
            return None
        shown = "; ".join(refused[:3]) + (f"; and {len(refused) - 3} more" if len(refused) > 3 else "")
        return (
            f"{len(refused)} of the sweep's {len(jobs)} jobs would fail, so none ran: {shown}; "
            "fix or drop those values and run the sweep again"
        )

    @staticmethod
    def another_sweep(config: DictConfig) -> str | None:
        sweep_dir = Path(config.hydra.sweep.dir)
        if not (sweep_dir / "multirun.yaml").is_file():
            return None
        from miniverl.utils.run_folder import ERROR_FILE, FINISHED_MARKERS  # torch and peft: only in this case

        jobs = [job for job in sweep_dir.iterdir() if job.is_dir()]
        ran = any((job / name).exists() for job in jobs for name in (*FINISHED_MARKERS, ".hydra", ERROR_FILE))
        if not ran:
            return None
        earlier = OmegaConf.load(sweep_dir / "multirun.yaml").hydra
        if any("shuffle(" in o for o in sweep_arguments(config.hydra)):
            return (
                f"hydra.sweep.dir={sweep_dir} holds a shuffle() sweep's runs, and shuffle() numbers the jobs anew each "
                "time, so its job folders cannot be matched to this run's jobs: choose another hydra.sweep.dir"
            )
        if (config_flags(earlier), numbered_jobs(earlier)) != (config_flags(config.hydra), numbered_jobs(config.hydra)):
            # Without trainer.overwrite=true: to go on with that sweep is to keep its finished jobs and resume.
            task = as_typed(earlier.overrides.task)
            kept = [o for o in task if override_key(o) != "trainer.overwrite"]
            afresh = any(o.split("=", 1)[-1].lower() == "true" for o in task if o not in kept)
            return (
                f"hydra.sweep.dir={sweep_dir} holds the runs of another sweep (its arguments: "
                f"{' '.join([*config_flags(earlier), *kept])}); choose another hydra.sweep.dir, or run that sweep's "
                "command to go on with it"
                + (" (without the trainer.overwrite=true it had: that would start every job afresh)" if afresh else "")
            )
        afresh = "every job starts afresh (trainer.overwrite=true)"
        what = (
            afresh if OmegaConf.select(config, "trainer.overwrite") else "finished jobs are kept, stopped ones resume"
        )
        logging.getLogger("miniverl").info("sweep folder %s holds this sweep's runs: %s", sweep_dir, what)
        return None


# Keys that say how a command runs, not what it computes: the same sweep again may set them otherwise
# (trainer.overwrite=true asks its jobs to start afresh in their folders).
RUN_CONTROL_KEYS = ("trainer.overwrite", "trainer.progress_bar", "trainer.stop_after_updates")


def sweep_arguments(hydra_cfg: DictConfig, leave_out: tuple[str, ...] = ()) -> list[str]:
    """The sweep's overrides, hydra.sweeper.params first (as Hydra reads them), but the keys in `leave_out`."""
    params = OmegaConf.to_container(OmegaConf.select(hydra_cfg, "sweeper.params") or OmegaConf.create({}))
    return [
        o
        for o in [*(f"{k}={v}" for k, v in params.items()), *as_typed(hydra_cfg.overrides.task)]
        if override_key(o) not in leave_out
    ]


def each_job(arguments: list[str]) -> list[list[str]] | None:
    """Each job's overrides, numbered as Hydra's basic sweeper numbers the jobs (the order the swept
    keys come in); None for a sweep that cannot be expanded here: shuffle() numbers its jobs at
    random, glob() needs Hydra's config loader."""
    from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
    from hydra.core.override_parser.overrides_parser import OverridesParser

    if any("shuffle(" in o for o in arguments):
        return None
    try:
        return BasicSweeper.split_arguments(OverridesParser.create().parse_overrides(arguments), None)[0]
    except Exception:
        return None


def numbered_jobs(hydra_cfg: DictConfig) -> list[list[str]]:
    """Each job's overrides but RUN_CONTROL_KEYS, as Hydra numbers the jobs; for a sweep that cannot
    be expanded here, its arguments themselves, sorted."""
    arguments = sweep_arguments(hydra_cfg, RUN_CONTROL_KEYS)
    jobs = each_job(arguments)
    return [sorted(arguments)] if jobs is None else [sorted(job) for job in jobs]
