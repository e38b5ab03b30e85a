"""Whether a teacher can score the student's token ids: the two tokenizers (vocabulary, special
tokens, chat template), the output layers' rows, and the ids that end a response."""

from __future__ import annotations

import types

import transformers
from jinja2 import TemplateError
from transformers import PreTrainedModel

from miniverl.models.sources import Source
from miniverl.utils.errors import MiniverlError
from miniverl.utils.text_alignment import is_special_token

PROBE_CONVERSATION = [
    {"role": "system", "content": "You are helpful."},
    {"role": "user", "content": "What is 12 + 30? ünïcode ✓"},
]


def stop_token_ids(tokenizer, model: PreTrainedModel) -> list[int]:
    """Every id that ends a response: the tokenizer's EOS and the generation config's EOS ids
    (Qwen3's generation config ends on `<|im_end|>` and `<|endoftext|>`)."""
    ids = {tokenizer.eos_token_id}
    configured = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    ids.update([configured] if isinstance(configured, int) else (configured or []))
    return sorted(i for i in ids if i is not None)


def configured_stop_ids(tokenizer, source: Source) -> list[int]:
    """stop_token_ids before the model loads: the tokenizer's EOS and the ids of the folder's
    generation_config.json, or without one those of its config.json (as transformers then derives
    the model's generation config); neither readable: the tokenizer's alone."""
    try:
        config = transformers.GenerationConfig.from_pretrained(source.path, revision=source.revision)
    except (OSError, ValueError):
        try:
            model_config = transformers.AutoConfig.from_pretrained(source.path, revision=source.revision)
            config = transformers.GenerationConfig.from_model_config(model_config)
        except (OSError, ValueError):
            config = None
    return stop_token_ids(tokenizer, types.SimpleNamespace(generation_config=config))


def stop_ids_problem(tokenizer, stops: list[int]) -> str | None:
    """Why the ids that end a response do not fit the chat template, or None: an id that is an ordinary
    piece of text (a response would end mid-word whenever it is sampled; a generation config written
    for another tokenizer), or the template's end of an assistant turn not among them (a trained
    student would run on past its turn: transformers' default Qwen2 config ends on <|endoftext|> alone)."""
    ordinary = [i for i in stops if not is_special_token(tokenizer, i)]
    if ordinary:
        pieces = ", ".join(f"{i} ({tokenizer.convert_ids_to_tokens(i)!r})" for i in ordinary)
        return (
            f"responses would end at {pieces}, an ordinary piece of text in this tokenizer: the model folder's "
            "generation_config.json (eos_token_id) may be another tokenizer's; list its end-of-turn token there"
        )
    turn_end = assistant_turn_end(tokenizer)
    if turn_end is not None and turn_end not in stops:
        return (
            f"the chat template ends an assistant turn with {tokenizer.convert_ids_to_tokens(turn_end)!r} "
            f"(id {turn_end}), which does not end a response (ids {stops}): add it to eos_token_id in the model "
            "folder's generation_config.json"
        )
    return None


def assistant_turn_end(tokenizer) -> int | None:
    """The first special token the chat template writes after an assistant's answer, or None."""
    answer = "Forty-two."
    for probe in (PROBE_CONVERSATION, PROBE_CONVERSATION[1:]):  # Gemma's and Mistral's templates refuse a system turn
        try:
            text = tokenizer.apply_chat_template([*probe, {"role": "assistant", "content": answer}], tokenize=False)
            break
        except TemplateError:  # the template's own raise_exception(...)
            continue
        except (ValueError, TypeError, AttributeError):  # no template, or one without an assistant turn
            return None
    else:
        return None
    end = text.rfind(answer)
    if end < 0:
        return None
    tail = tokenizer(text[end + len(answer) :], add_special_tokens=False)["input_ids"]
    return next((i for i in tail if is_special_token(tokenizer, i)), None)


def output_rows_problem(student_rows: int, teacher_rows: int, tokens: int) -> str | None:
    """Why a teacher's output layer cannot score the student's ids, or None when it can.

    Rows past the shared tokenizer are padding (Qwen3: 151,936 rows for 151,669 tokens); no role
    ever samples or scores them, so padding counts may differ (Qwen2.5-7B's 152,064 rows against
    Qwen2.5-1.5B's 151,936)."""
    short = [
        f"{who} has {rows}" for who, rows in (("teacher", teacher_rows), ("student", student_rows)) if rows < tokens
    ]
    if short:
        return (
            f"the tokenizer has {tokens} tokens but the {' and the '.join(short)} output rows: its output "
            "layer cannot score every token id; pick a model of the tokenizer's vocabulary"
        )
    return None


VOCABULARIES_DIFFER = "tokenizer vocabularies differ"  # the one difference text alignment is for


def tokenizer_problem(
    student_tok, teacher_tok, student_rows: int, teacher_rows: int, where: str = "teacher"
) -> str | None:
    """Why the teacher (config path `where`) cannot score the student's token ids (both must mean
    the same thing by each id, and render conversations alike), or None. `*_rows`: the output layers' rows."""
    problem = tokenizers_differ(student_tok, teacher_tok, where)
    if problem and where.startswith("--"):  # a bench flag: the bench has no tokenizer_alignment setting
        return f"{problem}; the bench measures a pair of one tokenizer: give {where} a model of the student's"
    if problem and not problem.startswith(VOCABULARIES_DIFFER):  # one vocabulary, other settings: the line has its fix
        return problem
    if problem and where.startswith("teachers."):  # text alignment serves the single `teacher` only
        return (
            f"{problem}; a teacher of another tokenizer scores text as the single `teacher` only "
            "(teacher.tokenizer_alignment=text): each of several teachers shares the student's tokenizer"
        )
    if problem:
        return f"{problem}; to distil from a teacher with another tokenizer, set {where}.tokenizer_alignment=text"
    problem = output_rows_problem(student_rows, teacher_rows, len(student_tok))
    return f"output layers: {problem}" if problem else None


def rendered(tokenizer, conversation: list[dict]) -> str:
    """The chat template's text of `conversation` with the generation prompt, or the error the template
    raises (Gemma's and Mistral's refuse a system turn): two templates that refuse alike render alike."""
    try:
        return tokenizer.apply_chat_template(conversation, add_generation_prompt=True, tokenize=False)
    except TemplateError as error:
        return f"<the template refuses it: {error}>"


def tokenizers_differ(student_tok, teacher_tok, where: str = "teacher") -> str | None:
    """How the two tokenizers differ (vocabulary, special tokens, chat template), or None when a
    token id and a rendered conversation mean the same to both; of one vocabulary, with its fix (the
    teacher `where` given the student's tokenizer)."""
    s_vocab, t_vocab = student_tok.get_vocab(), teacher_tok.get_vocab()
    if s_vocab != t_vocab:
        differing = len(set(s_vocab.items()) ^ set(t_vocab.items()))
        return (
            f"{VOCABULARIES_DIFFER}: student {len(s_vocab)} tokens, teacher {len(t_vocab)} ({differing} "
            "entries differ); on-policy distillation needs a teacher of the same tokenizer family"
        )
    # The EOS ends a response for both. Not the pad token: the teacher is given the student's pad id, and padded
    # positions are masked out of every score (an audit: a teacher folder that named another pad was refused).
    if student_tok.eos_token != teacher_tok.eos_token:  # a base and an instruct release of one family, often
        return (
            f"special tokens differ: eos_token {student_tok.eos_token!r} vs {teacher_tok.eos_token!r}, of one "
            f"vocabulary; set {where}.tokenizer_id to the student's tokenizer, or model.tokenizer_id to the "
            "teacher's (the student's responses then end at the teacher's end of turn)"
        )
    # With a system message and without: a template's default system prompt (Qwen2.5's against Qwen2's) shows
    # only in the second, and the data's rows mostly have none.
    tokenizers = (student_tok, teacher_tok)
    for probe, which in ((PROBE_CONVERSATION, ""), (PROBE_CONVERSATION[1:], " without a system message")):
        a, b = (rendered(t, probe) for t in tokenizers)
        if a != b:
            at = max(0, next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b))) - 20)
            return (
                f"chat templates render the probe conversation{which} differently: {a[at : at + 60]!r}... vs "
                f"{b[at : at + 60]!r}...; set {where}.tokenizer_id to the student's tokenizer or pick a matching "
                "teacher"
            )
    return None


def check_tokenizers_compatible(
    student_tok, teacher_tok, student: PreTrainedModel, teacher: PreTrainedModel, where: str = "teacher"
) -> None:
    """The teacher scores the student's token ids: refuse a pair that cannot (tokenizer_problem)."""
    rows = [m.get_output_embeddings().weight.shape[0] for m in (student, teacher)]
    problem = tokenizer_problem(student_tok, teacher_tok, *rows, where)
    if problem:
        raise MiniverlError(f"{where} and student: {problem}")
