"""How miniverl's Hydra apps start and fail: Hydra's composition errors as one line, the console
scripts run as `python -m` runs them, `--help`'s header, and lines for the run folder's main.log."""

import difflib
import functools
import logging
import os
import re
import runpy
import shlex
import sys
from collections.abc import Callable
from pathlib import Path

import yaml
from hydra.experimental.callback import Callback
from omegaconf import DictConfig, OmegaConf, open_dict, read_write

from miniverl.config import ENTRY_VERL_HINTS, unknown_key_fix
from miniverl.utils.errors import MiniverlError, ctrl_c_stop, exit_code_of, unwritable
from miniverl.utils.overrides import looks_numeric, override_key, shell_override
from miniverl.utils.signals import signal_of


def run_as_main(module: str) -> None:
    """Run `module` as `python -m module` does: a console script (`miniverl`, `miniverl-doctor`, ...)
    then finds conf/ as the command does (Hydra resolves config_path from the file of a __main__
    module, but as a Python package for an imported one)."""
    sys.modules.pop(module, None)  # the console script imported it to call this; run it afresh
    runpy.run_module(module, run_name="__main__", alter_sys=True)


# The shipped configs: the `config_path="../conf"` of miniverl's @hydra.main entry points.
SHIPPED_CONFIG_DIR = Path(__file__).resolve().parents[2] / "conf"


def as_typed(overrides) -> list[str]:
    """Hydra's list of overrides (`overrides.task`, `overrides.hydra`) as typed: iterating the ListConfig would
    resolve a `${...}` in one (trainer.experiment_name=${recipe.name}) against Hydra's own config, and fail."""
    return OmegaConf.to_container(overrides) if overrides is not None else []


def config_flags(hydra_cfg: DictConfig) -> list[str]:
    """The command line's flags that chose the config (`--config-path`, `--config-dir`,
    `--config-name`, `hydra.searchpath=`): Hydra keeps them out of `overrides.task`, and the same
    overrides run without them compose another config (a user's own recipe is not found)."""
    flags = []
    for source in hydra_cfg.runtime.config_sources:
        if source.schema != "file":  # pkg://: the shipped conf/ when miniverl.main is imported, not run
            continue
        if source.provider == "main" and Path(source.path).resolve() != SHIPPED_CONFIG_DIR:
            flags.append(f"--config-path={source.path}")
        elif source.provider == "command-line":
            flags.append(f"--config-dir={source.path}")
    if hydra_cfg.job.config_name != "config":
        flags.append(f"--config-name={hydra_cfg.job.config_name}")
    return flags + [o for o in as_typed(hydra_cfg.overrides.hydra) if override_key(o) == "hydra.searchpath"]


def log_line(
    logger: logging.Logger, message: str, level: int = logging.INFO, *, console: bool = False, main_log: bool = True
) -> None:
    """A line for the run folder's main.log (Hydra's file handler); with `console` on the console too,
    as any log line. Without it the console has the line already (printed) or shows the progress bar.
    `main_log=False` (with `console`): the console alone, for a line written before the folder is
    known to be this run's (a refused command leaves an earlier run's log as it was)."""
    if console and main_log:
        logger.log(level, message)
        return
    record = logger.makeRecord(logger.name, level, __file__, 0, message, None, None)
    for handler in logging.getLogger().handlers:
        if main_log if isinstance(handler, logging.FileHandler) else console:
            handler.handle(record)


def app_help() -> str:
    """`--help`'s header (conf/config.yaml: hydra.help.header): the docstring of the module running as
    __main__ (miniverl.main, miniverl.doctor, miniverl.export), which says what the command does."""
    doc = getattr(sys.modules.get("__main__"), "__doc__", None) or ""
    return doc.strip() + "\n"


OmegaConf.register_new_resolver("app_help", app_help, replace=True)


# Lines of Hydra's composition messages that say nothing a user acts on: OmegaConf's node types,
# and "To append ... use +key", which a typed schema refuses as well.
_HYDRA_NOISE = ("To append to your config", "full_key:", "reference_type=", "object_type=")


def hydra_error_line(error: Exception, verl_hints: Callable[[], dict[str, str]] | None = None) -> str:
    """Hydra's own wording of a composition error (and its OmegaConf cause) as one line, with the
    fix: the closest key of the node for a misspelt key (for a key of verl's, its fix from `verl_hints`:
    verl key -> the line that says miniverl's name for it, or why there is none), the options of a group for a
    missing one."""
    text = str(error)
    cause = error.__cause__
    if cause is not None and type(cause).__module__.startswith("omegaconf"):
        text += "\n" + str(cause)
    parts: list[str] = []
    for line in text.splitlines():
        if line.startswith("Config search path"):
            break  # Hydra's search path follows the options: where it looked, not what to do
        if not line.strip() or line.strip().startswith(_HYDRA_NOISE):
            continue
        if line.startswith(("\t", "    ")) and parts and parts[-1].endswith(":"):
            parts[-1] += " " + line.strip()  # the first option of a list
        elif line.startswith(("\t", "    ")) and parts and ":" in parts[-1]:
            parts[-1] += ", " + line.strip()
        else:
            parts.append(line.strip().rstrip("."))
    message = "; ".join(parts)
    key, node = getattr(cause, "key", None), getattr(cause, "parent_node", None)
    if "not in" in message and key is not None and node is not None:
        full_key = getattr(cause, "full_key", key)
        node_keys = [str(k) for k in node.keys()]
        prefix = full_key.rsplit(".", 1)[0] + "." if "." in full_key else ""
        given = re.search(r"override '([^']+)'", message)  # the whole key as typed (full_key stops at the miss)
        typed = given.group(1) if given else full_key
        fix = unknown_key_fix(f"{prefix}{key}", node_keys)
        close = difflib.get_close_matches(str(key), node_keys, n=1)
        if OmegaConf.get_type(node) is dict and not close:  # a mapping of the user's own keys: a new one takes a +
            fix = (
                f"a teacher is added with +teacher@{prefix}{key}=<option> (docs/teachers.md)"
                if prefix == "teachers."
                else f"{typed} is a new key of a mapping: add it with a +, +{typed}=<value>"
            )
        fix = (verl_hints() if verl_hints else {}).get(typed) or fix
        message += f"; {fix}"
    elif "does not support sweep type" in message:
        message += "; list the values (a,b,c), or sweep with range(), choice() or glob()"
    elif "could not be converted" in message:
        message += "; give it a value of the type its schema in miniverl/config/ declares"
    elif "is not a ListConfig, list or tuple" in message:
        message += "; the key holds a list: give one in brackets, key=[value] (key=[a,b] for two)"
    elif "LexerNoViableAlt" in message and "~" in message:
        message += (
            "; Hydra's override grammar has no bare ~ in a value: write the path with $HOME (the shell expands it)"
        )
    elif isinstance(getattr(error, "override", None), str):  # Hydra's grammar refused the override
        message = f"{error.override}: {message}; quote the value for Hydra inside the shell's quotes: \"key='...'\""
    return message


def hydra_arguments(arguments: list[str]):
    """A command line as Hydra's own parser reads it: (its namespace, what it leaves over), None where
    the parser refuses it itself (a flag's value it does not know: it says so)."""
    from hydra._internal.utils import get_args_parser  # the parser @hydra.main runs

    try:
        return get_args_parser().parse_known_args(arguments)
    except SystemExit:
        return None


def first_override_at(arguments: list[str]) -> int:
    """Where a command line's overrides start (its length: none), as Hydra's parser reads it: a flag's
    value (-cd /a=b) is not one."""
    from hydra._internal.utils import get_args_parser

    valued = {s for a in get_args_parser()._actions if a.option_strings and a.nargs != 0 for s in a.option_strings}
    starts = (i for i, a in enumerate(arguments) if "=" in a and not a.startswith("-"))
    return next((i for i in starts if i == 0 or arguments[i - 1] not in valued), len(arguments))


def argument_problem(arguments: list[str]) -> str | None:
    """What Hydra would refuse with its usage block or a traceback, or take otherwise than meant:
    overrides on both sides of a flag (argparse's "unrecognized arguments"), a flag it does not have, a
    list as a config group's option (Hydra merges the options into one config, silently), null,
    true/false or a number as one (shipped groups and those of --config-dir). None: nothing."""
    read = hydra_arguments(arguments)
    if read is None:
        return None
    parsed, stray = read
    if stray and stray[0].startswith("-"):
        return f"{stray[0]} is not one of Hydra's flags (--help lists them)"
    if stray:
        return (
            f"{stray[0]} follows one of Hydra's flags that follows an override: give the flags (-m, --cfg, "
            "--config-dir, ...) before or after all the overrides, not between them"
        )
    groups = {p.name for p in SHIPPED_CONFIG_DIR.iterdir() if p.is_dir() and p.name != "hydra"}
    own = Path(parsed.config_dir) if parsed.config_dir else None
    if own is not None and own.is_dir():
        groups |= {p.name for p in own.iterdir() if p.is_dir()}
    for override in parsed.overrides:
        key, _, value = override.partition("=")
        group = override_key(key).split("@", 1)[0]
        if group not in groups or not value or "=" not in override:
            continue
        options = sorted({p.stem for d in (SHIPPED_CONFIG_DIR, own) if d for p in (d / group).glob("*.yaml")})
        listed = f"one of {', '.join(options)}" if options else "a file's name in it"
        if value.startswith("["):
            return (
                f"{override}: the config group {group} takes one option's name, {listed}; to run each, sweep with "
                f"-m: {key}={value.strip('[]')}"
            )
        if value == "null" or value.lower() in ("true", "false") or looks_numeric(value):
            quoted = f"; an option named {value} is quoted for Hydra: \"{key}='{value}'\"" if value != "null" else ""
            return f"{override}: the config group {group} takes one option's name, {listed}{quoted}"
    return None


RUN_DIR_FIX = "choose another hydra.run.dir (hydra.sweep.dir with -m)"
SWEEP_DIR: list[Path] = []  # the folder of the sweep this command runs, once SweepPreflight has let it start
# The descriptor that holds that folder's lock until the command ends, and the folder where the lock made it.
SWEEP_LOCK: list[tuple[int, Path | None]] = []


def yaml_error_line(error: yaml.YAMLError) -> str:
    """A YAML parser's error in one line: the file and line of the problem, and what it is."""
    mark = getattr(error, "problem_mark", None)
    where = f"{mark.name}, line {mark.line + 1}" if mark is not None else "a config file"
    what = "; ".join(str(part) for part in (getattr(error, "context", None), getattr(error, "problem", None)) if part)
    return f"{where}: not valid YAML ({what or error}); fix the file"


def one_line_hydra_errors(entry: Callable | None = None, *, verl_hints: Callable[[], dict[str, str]] | None = None):
    """Wrap a `@hydra.main` entry point so that Hydra's composition errors (an unknown key, a
    value of the wrong type, a missing config option, an override it cannot parse), which are
    user mistakes, end like every other one: one line on stderr, exit 2 (HYDRA_FULL_ERROR=1:
    Hydra's own report). `verl_hints` (called on an error only): verl's keys -> the fix for each."""
    if entry is None:  # @one_line_hydra_errors(verl_hints=...)
        return functools.partial(one_line_hydra_errors, verl_hints=verl_hints)

    @functools.wraps(entry)
    def wrapped(*args, **kwargs):
        from hydra._internal import utils as hydra_internal
        from hydra.errors import HydraException

        original = hydra_internal.run_and_report

        def run_and_report(func):
            full_error = os.environ.get("HYDRA_FULL_ERROR") == "1"

            def guarded():
                try:
                    return func()
                except HydraException as error:  # composition; a sweep a sweeper cannot run (interval())
                    if full_error:
                        raise
                    raise SystemExit(exit_code_of(MiniverlError(hydra_error_line(error, verl_hints)))) from None
                except yaml.YAMLError as error:  # a config file of the user's (--config-dir) that is not YAML
                    if full_error:
                        raise
                    raise SystemExit(exit_code_of(MiniverlError(yaml_error_line(error)))) from None
                except KeyboardInterrupt as stop:  # outside the command's own code: Hydra's imports, between jobs
                    by = signal_of(stop)
                    go_on = "run the same command again to go on"
                    if SWEEP_DIR:  # a sweep between two jobs, or joblib's launcher waiting for its jobs
                        go_on = (
                            f"the sweep stopped (what ran: python -m miniverl.sweep_summary "
                            f"{shlex.quote(str(SWEEP_DIR[0]))}); to go on with every job, run the sweep's command "
                            f"again with {shell_override('hydra.sweep.dir', SWEEP_DIR[0])}"
                        )
                    raise SystemExit(exit_code_of(ctrl_c_stop(f"stopped by {by.name}; {go_on}", by))) from None
                except ValueError as error:  # logging's dictConfig: "Unable to configure handler 'file'"
                    if str(error).startswith("Config group override must be") and not full_error:
                        # a group's option that argument_problem did not read (a group of a searchpath)
                        fix = "give the config group an option's name (one that reads as a number: quoted, \"g='3'\")"
                        raise SystemExit(exit_code_of(MiniverlError(f"{error}: {fix}"))) from None
                    if not isinstance(error.__cause__, OSError):
                        raise
                    fix = RUN_DIR_FIX + going_on(error.__cause__.filename)
                    raise SystemExit(exit_code_of(unwritable(error.__cause__, fix))) from None
                except OSError as error:  # Hydra creates the run folder (and its log) before our code runs
                    if isinstance(error, (FileExistsError, NotADirectoryError)):  # a file where a folder goes
                        path = Path(error.filename)
                        in_the_way = next((p for p in (path, *path.parents) if p.is_file()), path)
                        line = MiniverlError(f"{in_the_way} is a file, not a folder: {RUN_DIR_FIX}")
                    elif isinstance(error, FileNotFoundError):  # a parent that holds no folders (/proc)
                        line = MiniverlError(f"cannot make {error.filename}: {error.strerror}; {RUN_DIR_FIX}")
                    else:
                        line = unwritable(error, RUN_DIR_FIX + going_on(error.filename))
                    raise SystemExit(exit_code_of(line)) from None

            return original(guarded)

        # Hydra has no public hook for this: `@hydra.main` composes the config and prints its
        # errors inside `hydra._internal.utils.run_and_report`, before any of our code runs, and
        # composing with the compose API instead would lose what @hydra.main gives (multirun,
        # launchers, --cfg, the run folder). So that one helper is swapped, only while the entry
        # point runs; tests/e2e/test_cli.py (a composition mistake in one line) fails if a Hydra release moves it.
        if (problem := argument_problem(sys.argv[1:])) and os.environ.get("HYDRA_FULL_ERROR") != "1":
            raise SystemExit(exit_code_of(MiniverlError(problem)))
        hydra_internal.run_and_report = run_and_report
        SWEEP_DIR.clear()  # one process may run several commands (the tests)
        ENTRY_VERL_HINTS[:] = [verl_hints]  # for SweepPreflight, which Hydra builds from the config, and to_config
        try:
            return entry(*args, **kwargs)
        except ValueError as error:  # Hydra's own check of its flags, before any of the above: `-m ... --cfg job`
            if not str(error).startswith("Only one of --run") or os.environ.get("HYDRA_FULL_ERROR") == "1":
                raise
            raise SystemExit(exit_code_of(MiniverlError(f"{error}: give one of them"))) from None
        finally:
            hydra_internal.run_and_report = original
            ENTRY_VERL_HINTS.clear()
            for descriptor, made in SWEEP_LOCK:  # the sweep's folder, free for the next command (the tests run several)
                os.close(descriptor)
                if made is not None and not any(made.iterdir()):  # refused by Hydra after the lock: nothing written
                    made.rmdir()
            SWEEP_LOCK.clear()

    return wrapped


def going_on(unwritable_file: str | None) -> str:
    """For a run folder that cannot be written (its main.log, its .hydra/): how a new folder goes on from the
    checkpoints it holds, where it holds some (a stopped run's folder made read-only, say)."""
    folders = Path(unwritable_file).parents[:2] if unwritable_file else ()
    run_dir = next((folder for folder in folders if (folder / "checkpoints").is_dir()), None)
    if run_dir is None:
        return ""
    return f", and add {shell_override('trainer.resume_from', run_dir)} to go on from its checkpoints"


def refuse_an_empty_folder(config: DictConfig, key: str) -> None:
    """An empty run or sweep folder (`hydra.run.dir=$OUT` with OUT unset) is the working directory:
    the run's files would land among the user's own. Refused before Hydra creates or writes anything."""
    if not str(OmegaConf.select(config, key) or "").strip():
        print(
            f"miniverl: error: {key} is empty (an unset shell variable?): give the folder to write to, "
            f"or leave {key} out for a new dated folder under outputs/",
            file=sys.stderr,
        )
        raise SystemExit(2)


class KeepEarlierRunRecord(Callback):
    """Hydra rewrites <run dir>/.hydra/ (config, overrides) before the job starts. In a folder that
    already holds a run, which miniverl then resumes in place or refuses, or an export, which the
    export replaces or refuses, that record is the earlier command's: this job writes none, so a
    refused command changes nothing there (an export that replaced the earlier one writes its own
    record after: miniverl.export). The same in a folder of the user's own files that a run would
    replace, which miniverl refuses: no .hydra/ there, no error line in its main.log. With
    trainer.overwrite=true too (it may be refused: the folder in use, a wrong value): a run that replaces the
    old one (trainer.overwrite=true, or the restart of one killed before its first checkpoint) writes its own
    record once it holds the folder (write_record; an export never replaces a run)."""

    # Whether this command, an export, kept an earlier export's record (miniverl.export then writes
    # its own once the launch is written). Set at every command's start: one process may run several.
    kept_export_record = False

    def on_run_start(self, config: DictConfig, **kwargs) -> None:
        KeepEarlierRunRecord.kept_export_record = False
        refuse_an_empty_folder(config, "hydra.run.dir")
        run_dir = Path(config.hydra.run.dir)
        exporting = config.hydra.job.name == "export"
        if not run_dir.is_dir() or not any(run_dir.iterdir()):  # a new folder: nothing to keep
            return
        from miniverl.config.export import EXPORT_FOLDER
        from miniverl.utils.run_folder import holds_outputs  # torch and peft: only in this case

        run_here = holds_outputs(run_dir)  # a run's folder, or one holding what a run would replace: not ours
        if run_here or (exporting and (run_dir / EXPORT_FOLDER).is_dir()):
            with read_write(config.hydra), open_dict(config.hydra):
                config.hydra.output_subdir = None
            KeepEarlierRunRecord.kept_export_record = exporting and not run_here


def write_record(cfg: DictConfig, hydra_cfg: DictConfig, record: Path) -> None:
    """Hydra's own record of a command (what it writes into .hydra/ when it starts the job), written by a
    command that replaced the earlier one whose record KeepEarlierRunRecord kept."""
    record.mkdir(exist_ok=True)
    OmegaConf.save(cfg, record / "config.yaml")
    hydra_record = OmegaConf.create(OmegaConf.to_container(hydra_cfg))
    hydra_record.output_subdir = record.name  # as Hydra records it (KeepEarlierRunRecord set it aside)
    OmegaConf.save(OmegaConf.create({"hydra": hydra_record}), record / "hydra.yaml")
    OmegaConf.save(hydra_cfg.overrides.task, record / "overrides.yaml")
