"""Reading a verl launch back as its Hydra overrides: a launch script in the shape of verl's
examples (bash arrays, `${VAR:-default}`, `$(( ... ))`, then `python3 -m verl.trainer.main_ppo ...`;
read, never run) or an overrides file, one per line. import_verl.py maps what this reads."""

from __future__ import annotations

import ast
import json
import operator
import os
import re
from collections.abc import Mapping
from pathlib import Path

from miniverl.utils.errors import MiniverlError

ENTRY = re.compile(r"^verl\.trainer\.main_ppo\w*$")
# $(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd): the folder of the script itself.
_HERE = re.compile(r'cd\s+"?\$\(\s*dirname\s+"?\$\{?(BASH_SOURCE(\[0\])?|0)\}?"?\s*\)"?\s*&&\s*pwd(\s+-P)?')


# ---------------------------------------------------------------- reading a launch script


class _Shell:
    """Just enough of bash to read verl's launch scripts: assignments, arrays, quotes, parameter
    expansion (${V}, ${V:-word}, ${A[@]}), arithmetic $(( )), and the main_ppo command line."""

    def __init__(self, env: Mapping[str, str], script_dir: str | None = None):
        self.script_dir = script_dir
        self.vars: dict[str, str] = dict(env)
        self.arrays: dict[str, list[str]] = {}

    # -- words
    @staticmethod
    def _join(splice: str | list[str], current: list[str], out: list[str]) -> list[str]:
        """Append an expansion to the word being built; "${ARR[@]}" gives one word per element."""
        if not isinstance(splice, list):
            current.append(splice)
            return current
        if current:
            out.append("".join(current))
        out.extend(splice[:-1])
        return [splice[-1]] if splice else []

    def words(self, text: str) -> list[str]:
        out: list[str] = []
        i, n = 0, len(text)
        current: list[str] | None = None
        while i < n:
            c = text[i]
            if c in " \t\n":
                if current is not None:
                    out.append("".join(current))
                    current = None
                i += 1
                continue
            if c == "#" and current is None:
                while i < n and text[i] != "\n":
                    i += 1
                continue
            if current is None:
                current = []
            if c == "'":
                end = text.index("'", i + 1)
                current.append(text[i + 1 : end])
                i = end + 1
            elif c == '"':
                i += 1
                while text[i] != '"':
                    if text[i] == "\\" and text[i + 1] in '$"\\`':
                        current.append(text[i + 1])
                        i += 2
                    elif text[i] == "$":
                        splice, i = self._dollar(text, i, quoted=True)
                        current = self._join(splice, current, out)
                    else:
                        current.append(text[i])
                        i += 1
                i += 1
            elif c == "\\":
                current.append(text[i + 1] if i + 1 < n else "")
                i += 2
            elif c == "$":
                splice, i = self._dollar(text, i, quoted=False)
                current = self._join(splice, current, out)
            else:
                current.append(c)
                i += 1
        if current is not None:
            out.append("".join(current))
        return out

    def _dollar(self, text: str, i: int, quoted: bool) -> tuple[str | list[str], int]:
        if text.startswith("$((", i):
            end = _matching(text, i + 1)
            return str(self.arith(text[i + 3 : end - 1])), end + 1
        if text.startswith("$(", i):
            end = _matching(text, i + 1)
            if self.script_dir is not None and _HERE.fullmatch(text[i + 2 : end].strip()):
                return self.script_dir, end + 1  # the script's own folder
            return text[i : end + 1], end + 1  # another command substitution: kept as written (never run)
        if text.startswith("${", i):
            end = _matching(text, i + 1, "{", "}")
            body = text[i + 2 : end]
            array = re.fullmatch(r"(\w+)\[[@*]\]", body)
            if array:
                return list(self.arrays.get(array.group(1), [])), end + 1
            m = re.fullmatch(r"(\w+)(:?[-=+])(.*)", body, re.S)
            if m:
                name, op, word = m.groups()
                value = self.vars.get(name)
                unset = value is None or (op.startswith(":") and value == "")
                if op.endswith("+"):
                    return ("" if unset else self.word(word)), end + 1
                return (self.word(word) if unset else value), end + 1
            return self.vars.get(body, ""), end + 1
        m = re.compile(r"\$(\w+|[@*#?])").match(text, i)
        if m:
            name = m.group(1)
            if name in "@*":
                return [], m.end()
            return self.vars.get(name, ""), m.end()
        return "$", i + 1

    def word(self, text: str) -> str:
        return " ".join(self.words(text))

    def arith(self, expr: str) -> int:
        expr = re.sub(r"\$\{?(\w+)\}?", lambda m: self.vars.get(m.group(1), "0"), expr)
        expr = re.sub(r"[A-Za-z_]\w*", lambda m: self.vars.get(m.group(0), "0") or "0", expr)
        return _eval_int(ast.parse(expr.strip(), mode="eval").body)

    def stdin_lines(self, redirections: list[str]) -> list[str]:
        """The lines of the file a command reads as its standard input (`< FILE`), the script's
        folder first, then the working directory; [] without one."""
        for j, word in enumerate(redirections):
            if word.startswith("<") and not word.startswith("<<"):
                name = word[1:] or (redirections[j + 1] if j + 1 < len(redirections) else "")
                candidates = [Path(self.script_dir or ".") / name, Path(name)]
                path = next((c for c in candidates if c.is_file()), None)
                if path is None:
                    raise MiniverlError(
                        f"the launch's `xargs ... verl.trainer.main_ppo < {name}` reads {name}, which is not beside "
                        "the script nor in the working directory; give that overrides file itself"
                    )
                return override_lines(path.read_text(), path)
        return []

    # -- statements
    def run(self, text: str) -> list[str] | None:
        """The main_ppo command line's overrides, or None if the script has none."""
        text = text.replace("\\\n", " ")
        lines = text.split("\n")
        found: list[str] | None = None
        i = 0
        while i < len(lines):
            line = lines[i].strip()
            i += 1
            if not line or line.startswith("#"):
                continue
            m = re.match(r"^(?:export\s+|local\s+|declare\s+(?:-\w+\s+)?)?([A-Za-z_]\w*)=\((.*)$", line)
            if m:  # NAME=( ... ) over one or more lines
                body = m.group(2)
                while not _closes_array(body) and i < len(lines):
                    body += "\n" + lines[i]
                    i += 1
                self.arrays[m.group(1)] = self.words(body[: body.rstrip().rindex(")")])
                continue
            m = re.match(r"^(?:export\s+|local\s+)?([A-Za-z_]\w*)=(.*)$", line)
            if m:
                words = self.words(m.group(2)) if m.group(2) else [""]
                self.vars[m.group(1)] = words[0] if words else ""
                continue
            words = self.words(line)
            for k, word in enumerate(words):
                if ENTRY.match(word) and k >= 1 and words[k - 1] == "-m":
                    rest = words[k + 1 :]
                    end = next((j for j, w in enumerate(rest) if _SHELL_OPERATOR.match(w)), len(rest))
                    found = (found or []) + [w for w in rest[:end] if w]  # up to `| tee log`, `2>&1`, `&&` ...
                    if "xargs" in words[:k]:  # xargs ... main_ppo < overrides.txt: the file's lines follow
                        found += self.stdin_lines(rest[end:])
                    break
        return found


# A word that ends the command's arguments: a pipe, a list operator, or a redirection (2>&1, >log, <in).
_SHELL_OPERATOR = re.compile(r"^(\|[|&]?|&&?|;|\d*[<>].*)$")


def _closes_array(body: str) -> bool:
    depth, quote = 1, None
    for c in body:
        if quote:
            if c == quote:
                quote = None
        elif c in "'\"":
            quote = c
        elif c == "(":
            depth += 1
        elif c == ")":
            depth -= 1
            if depth == 0:
                return True
    return False


def _matching(text: str, start: int, open_: str = "(", close: str = ")") -> int:
    depth = 0
    for j in range(start, len(text)):
        if text[j] == open_:
            depth += 1
        elif text[j] == close:
            depth -= 1
            if depth == 0:
                return j
    raise MiniverlError(f"unbalanced {open_}{close} in the launch script near: {text[start : start + 40]!r}")


_OPS = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.FloorDiv: operator.floordiv,
    ast.Div: operator.floordiv,
    ast.Mod: operator.mod,
}


def _eval_int(node: ast.AST) -> int:
    if isinstance(node, ast.Constant) and isinstance(node.value, int):
        return node.value
    if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
        return _OPS[type(node.op)](_eval_int(node.left), _eval_int(node.right))
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
        return -_eval_int(node.operand)
    raise MiniverlError("the launch script's arithmetic $(( )) uses more than + - * / %")


def exported_for(path: str | Path) -> str | None:
    """The verl release miniverl's export wrote the launch at `path` for: `verl.version` of the
    field_rules.json beside it, else the `for verl vX.Y.Z` of run_opd.sh's header; None for another launch."""
    path = Path(path)
    try:
        return json.loads((path.parent / "field_rules.json").read_text())["verl"]["version"]
    except (OSError, ValueError, KeyError, TypeError):
        pass
    try:
        header = path.read_text().split("\nset ", 1)[0]
    except (OSError, UnicodeDecodeError):  # not readable as a launch: read_overrides says so
        return None
    found = re.search(r"^# Exported by miniverl .* for verl v(\d+\.\d+\.\d+)", header, re.MULTILINE)
    return found.group(1) if found else None


def release_note(path: str | Path, version: str | None) -> str | None:
    """What to say where a launch is read as another verl release than the one miniverl's export wrote
    it for (`--verl-version` against its header): that release's defaults fill what the launch leaves out."""
    written_for = exported_for(path)
    if version is None or written_for in (None, version):
        return None
    return (
        f"{path} was written for verl {written_for} (miniverl's export) and is read as verl {version} "
        f"(--verl-version): {version}'s defaults fill what it leaves out; leave --verl-version out to read it "
        "as written"
    )


def read_overrides(path: str | Path, env: Mapping[str, str] | None = None) -> list[str]:
    """The verl overrides of a launch script or an overrides file."""
    path = Path(path)
    give = (
        "; give a verl launch script or overrides file, such as the verl/run_opd.sh or verl/overrides.txt that "
        "`python -m miniverl.export +recipe=<name>` writes into its run folder"
    )
    try:
        text = path.read_text()
    except OSError as error:
        raise MiniverlError(f"cannot read {path}: {error.strerror}{give}") from None
    except UnicodeDecodeError:
        raise MiniverlError(f"cannot read {path}: not a text file{give}") from None
    if path.suffix == ".sh" or text.startswith("#!") or "verl.trainer.main_ppo" in text:
        try:
            found = _Shell(os.environ if env is None else env, str(path.resolve().parent)).run(text)
        except (ValueError, IndexError, ArithmeticError) as error:  # an unclosed quote, $((1/0)): not a shell's line
            raise MiniverlError(
                f"{path}: cannot read it as a shell script ({type(error).__name__}: {error}: an unclosed quote, or "
                f"arithmetic the reader cannot do){give}"
            ) from None
        if found is None:
            raise MiniverlError(f"{path}: no `python3 -m verl.trainer.main_ppo` command line found")
        return found
    return override_lines(text, path, give)


def override_lines(text: str, path: Path, give: str = "") -> list[str]:
    """The overrides of an overrides file's text: one key=value (or ~key) per line, # comments."""
    lines = [line.strip() for line in text.splitlines() if line.strip() and not line.lstrip().startswith("#")]
    if not lines or not all(
        line.startswith("~") or ("=" in line and " " not in line.split("=", 1)[0]) for line in lines
    ):
        raise MiniverlError(f"{path}: neither a launch script nor overrides (one key=value per line)" + give)
    return lines
