"""The README and docs/*.md name only things that exist.

For every command in a ``bash`` block (and every command in an inline code span): the
script it runs (``python X.py``, ``torchrun ... X.py``, ``bash scripts/X.sh``) exists, each
``make`` target is in the Makefile, each ``--flag`` given to ``pretrain/pretrain_gpt.py``
or to a tool is known to that program's parser, and each ``VAR=value`` given to a launch
script is a variable the script reads. Repository paths in backticks exist, and relative
markdown links resolve to a file (and to a heading, when they name one).

A tool's parser is found by running its ``main`` with ``ArgumentParser.parse_known_args``
patched to hand the parser back instead of parsing, so nothing else runs and no process is
spawned.
"""

from __future__ import annotations

import argparse
import functools
import importlib.util
import inspect
import re
import shlex
import sys
from dataclasses import dataclass
from pathlib import Path
from unittest import mock

import pytest

REPO = Path(__file__).resolve().parents[2]
TOP_DIRS = ("megalite", "tools", "tests", "scripts", "pretrain", "examples", "docs")
PYTHONS = {"python", "python3", ".venv/bin/python"}
TORCHRUNS = {"torchrun", ".venv/bin/torchrun"}
SHELLS = {"bash", "sh", "sbatch"}
PRETRAIN = "pretrain/pretrain_gpt.py"


def doc_files() -> list[Path]:
    return [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]


# ---- reading markdown ------------------------------------------------------------------

@dataclass
class Command:
    doc: str
    line: int
    tokens: list[str]

    def where(self) -> str:
        return f"{self.doc}:{self.line}: {shlex.join(self.tokens)}"


def split_fences(text: str) -> tuple[list[tuple[str, int, list[str]]], str]:
    """(fenced blocks as (language, first line number, lines), the text outside them).

    In the outside text, the blocks' lines are blank (so line numbers still count), and so
    are generated regions (``<!-- NAME:begin ... -->`` to ``<!-- NAME:end -->``): the
    Megatron flag table names files of Megatron-LM's repository, and its generator has a
    test of its own."""
    blocks, outside, block, generated = [], [], None, None
    for n, line in enumerate(text.split("\n"), 1):
        fence = re.match(r"\s*```(\S*)", line)
        begin = re.match(r"<!-- (\S+):begin", line)
        if generated:
            generated = None if line.startswith(f"<!-- {generated}:end") else generated
            outside.append("")
        elif begin and block is None:
            generated = begin.group(1)
            outside.append("")
        elif fence and block is None:
            block = (fence.group(1), n + 1, [])
            outside.append("")
        elif fence and line.strip() == "```":
            blocks.append(block)
            block = None
            outside.append("")
        elif block is not None:
            block[2].append(line)
            outside.append("")
        else:
            outside.append(line)
    return blocks, "\n".join(outside)


def tokenize(line: str) -> list[list[str]]:
    """A shell line -> its simple commands' tokens (split at ; & | && ( ), comments off).
    A line shlex cannot read (a quote continued on the next line) gives nothing."""
    lexer = shlex.shlex(line, posix=True, punctuation_chars=True)
    lexer.whitespace_split = True
    try:
        tokens = list(lexer)
    except ValueError:
        return []
    commands, current = [], []
    for tok in tokens:
        if tok and set(tok) <= set(";&|()"):
            commands.append(current)
            current = []
        else:
            current.append(tok)
    commands.append(current)
    return [c for c in commands if c]


def block_commands(doc: str, start: int, lines: list[str]) -> list[Command]:
    out, joined, first = [], "", None
    for n, line in enumerate(lines, start):
        first = n if not joined else first
        if line.rstrip().endswith("\\"):
            joined += line.rstrip()[:-1] + " "
            continue
        joined += line
        out += [Command(doc, first, toks) for toks in tokenize(joined)]
        joined = ""
    if joined:
        out += [Command(doc, first, toks) for toks in tokenize(joined)]
    return out


def inline_spans(outside: str) -> list[tuple[int, str]]:
    """(line number, text) of each inline code span outside the fenced blocks."""
    spans = []
    for m in re.finditer(r"(?<!`)`([^`]+)`(?!`)", outside):
        spans.append((outside.count("\n", 0, m.start()) + 1, m.group(1).replace("\n", " ")))
    return spans


def is_command(tokens: list[str]) -> bool:
    """Whether an inline code span's tokens are a command (``bash`` alone is a word)."""
    rest = strip_env(tokens)[1]
    return len(rest) > 1 and (rest[0] in PYTHONS | TORCHRUNS | SHELLS or rest[0] == "make")


@functools.cache
def all_commands() -> list[Command]:
    cmds = []
    for path in doc_files():
        doc = str(path.relative_to(REPO))
        blocks, outside = split_fences(path.read_text())
        for lang, start, lines in blocks:
            if lang in ("bash", "sh", "shell", "console"):
                cmds += block_commands(doc, start, lines)
        for line, span in inline_spans(outside):
            cmds += [Command(doc, line, t) for t in tokenize(span) if is_command(t)]
    return cmds


# ---- what exists -----------------------------------------------------------------------

@functools.cache
def make_targets() -> frozenset[str]:
    text = (REPO / "Makefile").read_text()
    return frozenset(re.findall(r"^([A-Za-z0-9_.-]+)\s*:(?!=)", text, flags=re.M))


class _Captured(Exception):
    def __init__(self, parser, args):
        self.parser, self.args = parser, args


def _load(path: Path):
    for p in (str(REPO), str(REPO / "tools")):
        if p not in sys.path:
            sys.path.insert(0, p)
    name = "_docs_" + re.sub(r"\W", "_", str(path.relative_to(REPO)))
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def _capture(path: Path, argv: list[str]) -> tuple[argparse.ArgumentParser, list[str]]:
    """(the parser ``path``'s ``main(argv)`` builds, the arguments main hands it), taken at
    its first parse."""
    module = _load(path)

    def grab(self, args=None, namespace=None):
        raise _Captured(self, list(args or []))

    main = module.main
    with mock.patch.object(argparse.ArgumentParser, "parse_known_args", grab), \
            mock.patch.object(sys, "argv", [str(path), *argv]):
        try:
            main(argv) if inspect.signature(main).parameters else main()
        except _Captured as got:
            return got.parser, got.args
    raise AssertionError(f"{path.relative_to(REPO)}: main() returned without parsing flags")


# pretrain_gpt.py takes these before its parser sees the rest
DRY_RUN = ["--dry-run", "--world-size", "1", "--rank", "0"]


@functools.cache
def known_flags(script: str) -> frozenset[str]:
    """The option strings ``script`` (a path under the repository) accepts."""
    probe = DRY_RUN if script == PRETRAIN else []
    parser, passed = _capture(REPO / script, probe)
    taken_before = [f for f in probe if f.startswith("--") and f not in passed]
    return frozenset([*parser._option_string_actions, *taken_before])


# ---- checking one command --------------------------------------------------------------

def strip_env(tokens: list[str]) -> tuple[list[str], list[str]]:
    """(the VAR names assigned before the command, the command's tokens)."""
    names = []
    while tokens and re.match(r"[A-Z_][A-Z0-9_]*=", tokens[0]):
        names.append(tokens[0].split("=", 1)[0])
        tokens = tokens[1:]
    return names, tokens


def flags_in(args: list[str]) -> list[str]:
    out = []
    for a in args:
        a = a.strip("[]")
        if a.startswith("--") and len(a) > 2 and not a.startswith("---"):
            out.append(a.split("=", 1)[0])
    return out


def check_flags(script: str, args: list[str]) -> list[str]:
    known = known_flags(script)
    return [f"{f} is not a flag of {script}" for f in flags_in(args) if f not in known]


def is_placeholder(token: str) -> bool:
    return token in ("...", "all") or token.isupper()


def check_script(script: str, args: list[str]) -> list[str]:
    if not (REPO / script).is_file():
        return [f"{script} does not exist"]
    if script == "tools/plan_layout.py" and "--" in args:
        k = args.index("--")
        return check_flags(script, args[:k]) + check_flags(PRETRAIN, args[k + 1:])
    if script == "tools/benchmark.py":
        if not args or is_placeholder(args[0]):
            return check_flags(script, []) if not args else []
        bench = f"tools/bench/{args[0].replace('-', '_')}.py"
        if not (REPO / bench).is_file():
            return [f"benchmark {args[0]!r}: {bench} does not exist"]
        return check_flags(bench, args[1:])
    return check_flags(script, args)


def check_shell_script(env: list[str], args: list[str]) -> list[str]:
    rest = [a for a in args if not a.startswith("-")]
    if not rest:
        return ["no script given"]
    script, extra = rest[0], args[args.index(rest[0]) + 1:]
    path = REPO / script
    if not path.is_file():
        return [f"{script} does not exist"]
    text = path.read_text()
    errors = [f"{script} does not read {name}" for name in env
              if not re.search(rf"\b{name}\b", text)]
    if extra and PRETRAIN in text and '"$@"' in text:
        errors += check_flags(PRETRAIN, extra)
    elif flags_in(extra):
        errors.append(f"{script} takes no flags")
    return errors


def check_command(tokens: list[str]) -> list[str]:
    env, tokens = strip_env(tokens)
    prog, args = tokens[0], tokens[1:]
    if prog == "make":
        return [f"make target {t!r} is not in the Makefile" for t in args
                if not t.startswith("-") and "=" not in t and t not in make_targets()]
    if prog in SHELLS:
        return check_shell_script(env, args)
    if prog in PYTHONS and args[:2] == ["-m", "pytest"]:
        return [f"{a} does not exist" for a in args[2:]
                if not a.startswith("-") and a.startswith("tests")
                and not (REPO / a.split("::")[0]).exists()]
    if prog in PYTHONS and args and args[0].endswith(".py"):
        return check_script(args[0], args[1:])
    if prog in TORCHRUNS:
        scripts = [i for i, a in enumerate(args) if a.endswith(".py")]
        if scripts:
            return check_script(args[scripts[0]], args[scripts[0] + 1:])
    return []


# ---- paths and links -------------------------------------------------------------------

PATH_RE = re.compile(rf"^(?:{'|'.join(TOP_DIRS)})/[\w./*-]*$")


def repo_paths(span: str) -> list[str]:
    """The repository paths in an inline code span, less placeholders (``bench/NAME.py``)."""
    out = []
    for token in span.split():
        token = token.strip(",;:()'\"").rstrip(".")
        parts = [p.split(".")[0] for p in token.split("/")]
        if PATH_RE.match(token) and not any(p.isupper() for p in parts):
            out.append(token)
    return out


def path_exists(path: str) -> bool:
    if "*" in path:
        return any(REPO.glob(path))
    return (REPO / path).exists()


def slug(heading: str) -> str:
    """GitHub's anchor for a heading."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


@functools.cache
def anchors(path: Path) -> frozenset[str]:
    _, outside = split_fences(path.read_text())
    seen: dict[str, int] = {}
    out = set()
    for m in re.finditer(r"^#{1,6}\s+(.+?)\s*#*$", outside, flags=re.M):
        base = slug(m.group(1))
        n = seen.get(base, 0)
        seen[base] = n + 1
        out.add(base if n == 0 else f"{base}-{n}")
    return frozenset(out)


LINK_RE = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")


def link_errors(path: Path) -> list[str]:
    doc = str(path.relative_to(REPO))
    _, outside = split_fences(path.read_text())
    errors = []
    for m in LINK_RE.finditer(outside):
        target = m.group(1)
        if re.match(r"[a-z][a-z0-9+.-]*:", target):  # http:, mailto:
            continue
        line = outside.count("\n", 0, m.start()) + 1
        file, _, anchor = target.partition("#")
        dest = (path.parent / file).resolve() if file else path
        if not dest.is_relative_to(REPO):
            errors.append(f"{doc}:{line}: {target} points outside the repository")
        elif not dest.exists():
            errors.append(f"{doc}:{line}: {target} does not exist")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            errors.append(f"{doc}:{line}: {target}: no heading #{anchor} in {file or doc}")
    return errors


def path_errors(path: Path) -> list[str]:
    doc = str(path.relative_to(REPO))
    _, outside = split_fences(path.read_text())
    return [f"{doc}:{line}: {p} does not exist"
            for line, span in inline_spans(outside)
            for p in repo_paths(span) if not path_exists(p)]


# ---- the tests -------------------------------------------------------------------------

def test_the_docs_name_commands():
    cmds = all_commands()
    assert len({c.doc for c in cmds}) >= 8, "fewer documents with commands than expected"
    assert any(strip_env(c.tokens)[1][:2] == ["make", "pretrain"] for c in cmds)
    assert any(PRETRAIN in c.tokens for c in cmds)


def test_every_command_runs_something_that_exists():
    errors = [f"{c.where()}\n    {e}" for c in all_commands() for e in check_command(c.tokens)]
    assert not errors, "commands in the docs that would not run:\n" + "\n".join(errors)


@pytest.mark.parametrize("path", doc_files(), ids=lambda p: str(p.relative_to(REPO)))
def test_paths_and_links_resolve(path):
    errors = path_errors(path) + link_errors(path)
    assert not errors, "\n".join(errors)


def test_nothing_points_outside_the_repository():
    hits = [f"{p.relative_to(REPO)}: {m.group(0)}" for p in doc_files()
            for m in re.finditer(r"\.\./shared/\S*", p.read_text())]
    assert not hits, "\n".join(hits)


# ---- the checks can fail ---------------------------------------------------------------

def _errors_in(tmp_path, text: str) -> list[str]:
    """Everything the checks above find in one document ``text``."""
    doc = tmp_path / "doc.md"
    doc.write_text(text)
    blocks, outside = split_fences(text)
    cmds = [c for lang, start, lines in blocks for c in block_commands("doc.md", start, lines)]
    cmds += [Command("doc.md", n, t) for n, s in inline_spans(outside) for t in tokenize(s)
             if is_command(t)]
    errors = [e for c in cmds for e in check_command(c.tokens)]
    errors += [e for _, s in inline_spans(outside) for p in repo_paths(s)
               if not path_exists(p) for e in [f"{p} does not exist"]]
    with mock.patch(f"{__name__}.REPO", tmp_path):
        errors += [e.split(": ", 1)[1] for e in link_errors(doc)]
    return errors


def test_a_wrong_flag_or_a_missing_path_is_caught(tmp_path):
    good = ("```bash\n"
            ".venv/bin/python pretrain/pretrain_gpt.py --num-layers 2 \\\n"
            "    --tensor-model-parallel-size 2 --dry-run --world-size 2\n"
            "torchrun --nproc-per-node 2 tools/generate.py --load DIR --top-p 0.9\n"
            "TRAIN_ITERS=5 bash scripts/pretrain_tiny_cpu.sh --log-interval 5\n"
            "python tools/benchmark.py memory --dp 1 2\n"
            "make test\n"
            "```\n"
            "See `tools/generate.py` and `tests/docs/`.\n")
    assert _errors_in(tmp_path, good) == []
    for old, new, expected in [
        ("--tensor-model-parallel-size 2", "--tensor-model-paralel-size 2",
         "--tensor-model-paralel-size is not a flag of pretrain/pretrain_gpt.py"),
        ("--top-p 0.9", "--top-q 0.9", "--top-q is not a flag of tools/generate.py"),
        ("TRAIN_ITERS=5", "TRAIN_ITER=5", "scripts/pretrain_tiny_cpu.sh does not read TRAIN_ITER"),
        ("--log-interval 5", "--log-intervall 5",
         "--log-intervall is not a flag of pretrain/pretrain_gpt.py"),
        ("memory --dp", "memory --dpp", "--dpp is not a flag of tools/bench/memory.py"),
        ("memory --dp", "memry --dp", "benchmark 'memry': tools/bench/memry.py does not exist"),
        ("make test", "make tset", "make target 'tset' is not in the Makefile"),
        ("tools/generate.py --load", "tools/generat.py --load", "tools/generat.py does not exist"),
        ("`tests/docs/`", "`tests/doc/`", "tests/doc/ does not exist"),
    ]:
        errors = _errors_in(tmp_path, good.replace(old, new))
        assert expected in errors, (new, errors)
    link = _errors_in(tmp_path, good + "[x](missing.md) [y](doc.md#no-such-heading)\n")
    assert any("missing.md does not exist" in e for e in link), link
    assert any("no heading #no-such-heading" in e for e in link), link
