"""`python -m miniverl.real_models`: build the real trained models the real recipes use, once per
machine, without a hub (miniverl/models/real_fixture.py says what they are).

    python -m miniverl.real_models                       # the teacher, the 15- and the 24-layer student
    python -m miniverl.real_models --keep-every 3 --offset 1   # another student: layers 1, 4, 7, ...
    python -m miniverl.real_models --drop-every 3        # another student: all but layers 2, 5, 8, ... (20 of 30)
    python -m miniverl.real_models --cross-tokenizer     # + the every-2nd-layer student with Qwen2's tokenizer

Prints the folders; `model.model_id` / `teacher.model_id` accept them (or any Hugging Face folder).
"""

from __future__ import annotations

import argparse

from miniverl.models import real_fixture
from miniverl.utils.errors import MiniverlError, exit_code_of


def main(argv: list[str] | None = None) -> int:
    description = __doc__.split("\n\n")[0]  # the first paragraph (argparse rewraps it)
    parser = argparse.ArgumentParser(prog="python -m miniverl.real_models", description=description)
    parser.add_argument(
        "--keep-every",
        type=int,
        default=None,
        help=f"student: keep every N-th layer (default {real_fixture.DEFAULT_KEEP_EVERY})",
    )
    parser.add_argument("--offset", type=int, default=0, help="student: the first layer kept (default 0)")
    parser.add_argument(
        "--drop-every", type=int, default=None, help="student: remove every N-th layer instead (N >= 2; 5: 24 of 30)"
    )
    parser.add_argument(
        "--cross-tokenizer",
        action="store_true",
        help="also the student of another tokenizer (Qwen2's), for +recipe=opd_k1_cross_tokenizer_cpu",
    )
    args = parser.parse_args(argv)
    if args.drop_every is not None and (args.offset or args.keep_every is not None):
        given = [f"--keep-every {args.keep_every}"] if args.keep_every is not None else []
        given += [f"--offset {args.offset}"] if args.offset else []
        parser.error(
            f"--drop-every {args.drop_every} with {' '.join(given)}: choose one cut (drop layers, or keep every N-th)"
        )
    if args.drop_every is not None and args.drop_every < 2:
        parser.error(f"--drop-every {args.drop_every}: need N >= 2 (2 drops every second layer)")
    cut_asked = args.keep_every is not None or args.drop_every is not None or args.offset
    args.keep_every = real_fixture.DEFAULT_KEEP_EVERY if args.keep_every is None else args.keep_every
    if args.keep_every < 1 or not 0 <= args.offset < args.keep_every:
        parser.error(
            f"--keep-every {args.keep_every} --offset {args.offset}: need --keep-every >= 1 and "
            "0 <= --offset < --keep-every"
        )
    cuts = [(args.keep_every, args.offset, args.drop_every)]
    if not cut_asked:  # the students the recipes and the bench use: the 15- and the 24-layer cut
        cuts.append((real_fixture.DEFAULT_KEEP_EVERY, 0, real_fixture.RECIPE_DROP_EVERY))
    folders = [
        ("teacher", real_fixture.teacher_dir()),
        *(("student", real_fixture.student_dir(None, *cut)) for cut in cuts),
    ]
    if args.cross_tokenizer:
        folders.append(("student of another tokenizer", real_fixture.cross_tokenizer_student_dir()))
    built_before = [(folder / "config.json").exists() for _, folder in folders]
    try:
        real_fixture.build_teacher()
        for keep_every, offset, drop_every in cuts:
            real_fixture.build_student(keep_every=keep_every, offset=offset, drop_every=drop_every)
        if args.cross_tokenizer:
            real_fixture.build_cross_tokenizer_student()
    except MiniverlError as error:
        return exit_code_of(error, "miniverl.real_models")
    for (name, folder), before in zip(folders, built_before, strict=True):
        print(f"{name}: {folder} ({'there already' if before else 'built now'})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
