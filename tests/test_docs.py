"""README.md and docs/ stay true to the code.

- Every command in a shell code block of README.md and docs/*.md names what exists: a `hetermoe`
  subcommand and flags its parser knows (the flags after `--` are the run's: Megatron-LM's, the
  --hetero-* ones or `hetermoe train`'s), a Makefile target, Megatron-LM's flags for `pretrain_gpt.py`
  under torchrun, the SLURM launcher's flags.
- docs/flags.md's tables list exactly the flags of each parser: every flag in a table exists, and
  every flag of a command is in its table.
- Relative links in README.md and docs/*.md point to files that exist.

Parsers are read the way a user reaches them: a command's main() is called with the command line and
the first parser it parses with is taken (argparse's parse_known_args, stopped there), so nothing runs
and the test does not depend on where a command builds its parser.
"""
from __future__ import annotations

import argparse
import importlib
import importlib.util
import re
import shlex
from pathlib import Path

import pytest

from megatron_hetermoe import commands as cli
from megatron_hetermoe.cli.hetero import add_hetero_args

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
FLAGS_PAGE = ROOT / "docs" / "flags.md"
MEGATRON_FLAGS_FILE = ROOT / "megatron_hetermoe" / "training" / "megatron_lm_flags.txt"
HELP = {"-h", "--help"}


class _Stop(BaseException):
    """Raised by the spy in place of parsing: the command does not run."""


def first_parser(main, argv: list[str]) -> argparse.ArgumentParser:
    """The first parser `main(argv)` parses with (its own: before it does anything else)."""
    seen: list[argparse.ArgumentParser] = []
    real = argparse.ArgumentParser.parse_known_args

    def spy(self, args=None, namespace=None):
        seen.append(self)
        raise _Stop

    argparse.ArgumentParser.parse_known_args = spy
    try:
        main(argv)
    except _Stop:
        pass
    finally:
        argparse.ArgumentParser.parse_known_args = real
    assert seen, f"{main.__module__}.main({argv}) parsed no flags"
    return seen[0]


def command_main(name: str):
    mod, fn = cli.SUBCOMMANDS[name][0].split(":")
    return getattr(importlib.import_module(mod), fn)


def options(p: argparse.ArgumentParser) -> set[str]:
    return {o for a in p._actions for o in a.option_strings}


def subparsers(p: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    return {n: sp for a in p._actions if isinstance(a, argparse._SubParsersAction) for n, sp in a.choices.items()}


def megatron_flags() -> set[str]:
    return {ln.strip() for ln in MEGATRON_FLAGS_FILE.read_text().splitlines() if ln.startswith("--")}


def hetero_flags() -> set[str]:
    return options(add_hetero_args(argparse.ArgumentParser(add_help=False))) - HELP


def run_flags() -> set[str]:
    """What may follow a `--`: the run's flags (Megatron-LM's, --hetero-*, `hetermoe train`'s)."""
    return megatron_flags() | hetero_flags() | options(first_parser(command_main("train"), ["--help"]))


def slurm_flags() -> set[str]:
    from megatron_hetermoe.tools import slurm

    return options(first_parser(slurm.main, ["--help"])) | {"--dry-run"}  # launch.sh takes --dry-run itself


def make_targets() -> set[str]:
    text = (ROOT / "Makefile").read_text()
    return set(re.findall(r"^([A-Za-z0-9][\w.-]*)\s*:(?!=)", text, re.M))


# ---- commands in code blocks ------------------------------------------------------------------

def shell_blocks(page: Path) -> list[str]:
    return re.findall(r"^```(?:bash|sh|shell)\n(.*?)^```", page.read_text(), re.M | re.S)


def commands(block: str) -> list[list[str]]:
    """Each command of a shell block as tokens: continuations joined, comments, <placeholders>,
    [optional] brackets and `...` dropped; `a && b` is two commands."""
    out = []
    for line in block.replace("\\\n", " ").splitlines():
        line = re.sub(r"(^|\s)#.*$", "", line)
        line = re.sub(r"<[^<>]*>", " ", line).replace("[", " ").replace("]", " ")
        for part in re.split(r"&&|;|\|\|", line):
            toks = [t for t in shlex.split(part) if t != "..."]
            while toks and re.fullmatch(r"[A-Z_][A-Z0-9_]*=.*", toks[0]):  # VAR=value cmd
                toks.pop(0)
            if toks:
                out.append(toks)
    return out


def flags_in(tokens: list[str]) -> list[str]:
    return [t.split("=", 1)[0] for t in tokens if re.fullmatch(r"--?[A-Za-z][\w-]*(=.*)?", t)]


def split_dashdash(tokens: list[str]) -> tuple[list[str], list[str]]:
    return (tokens[:tokens.index("--")], tokens[tokens.index("--") + 1:]) if "--" in tokens else (tokens, [])


def hetermoe_problems(args: list[str]) -> list[str]:
    top = first_parser(cli.main, ["--help"])
    i = 0
    while i < len(args) and args[i].startswith("-"):  # options before the command
        i += 2 if args[i] == "--config-dir" else 1
    bad = [f for f in flags_in(args[:i]) if f not in options(top)]
    if i == len(args):
        return bad
    name, rest = args[i], args[i + 1:]
    if name not in cli.SUBCOMMANDS:
        return [f"no command {name!r} (hetermoe --help: {', '.join(cli.SUBCOMMANDS)})"]
    own, after = split_dashdash(rest)
    parser = first_parser(command_main(name), own)
    subs = subparsers(parser)
    if subs:
        sub = next((t for t in own if not t.startswith("-")), None)
        if sub not in subs:
            return [f"hetermoe {name}: no subcommand {sub!r} ({', '.join(subs)})"]
        parser = subs[sub]
    known = options(parser) | {"--config-dir"}
    own_parser = first_parser(command_main(name), ["--help"])
    if parser is not own_parser:  # a switch of the command's own (bench --layer) hands the rest to another parser
        known |= {o for a in own_parser._actions if isinstance(a, argparse._StoreTrueAction) for o in a.option_strings}
    if name == "pretrain":  # this command's flags, then Megatron-LM's own with the --hetero-* ones
        known |= megatron_flags() | hetero_flags()
    bad += [f"hetermoe {name}: {f}" for f in flags_in(own) if f not in known]
    bad += [f"hetermoe {name} -- {f}" for f in flags_in(after) if f not in run_flags()]
    return bad


def command_problems(toks: list[str]) -> list[str]:
    prog = Path(toks[0]).name
    if prog == "hetermoe":
        return hetermoe_problems(toks[1:])
    if prog == "make":
        return [f"make {t}: no such target" for t in toks[1:] if not t.startswith("-") and "=" not in t
                and t not in make_targets()]
    if prog == "torchrun":
        if "-m" in toks:
            module = toks[toks.index("-m") + 1]
            assert importlib.util.find_spec(module), f"torchrun -m {module}: no such module"
            run = toks[toks.index("-m") + 2:]
        else:
            scripts = [i for i, t in enumerate(toks) if t.endswith(".py")]
            if not scripts or Path(toks[scripts[0]]).name != "pretrain_gpt.py":
                return []
            run = toks[scripts[0] + 1:]
        return [f"torchrun ... {f}" for f in flags_in(run) if f not in megatron_flags() | hetero_flags()]
    if prog == "launch.sh":
        own, after = split_dashdash(toks[1:])
        return ([f"launch.sh {f}" for f in flags_in(own) if f not in slurm_flags()]
                + [f"launch.sh -- {f}" for f in flags_in(after) if f not in run_flags()])
    return []


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_commands_in_code_blocks_exist(page):
    problems = [f"{' '.join(toks)}\n    -> {p}" for block in shell_blocks(page) for toks in commands(block)
                for p in command_problems(toks)]
    assert not problems, f"{page.relative_to(ROOT)}: commands that name what does not exist:\n" + "\n".join(problems)


def test_the_readme_keeps_its_two_set_up_commands_and_three_steps():
    text = (ROOT / "README.md").read_text()
    cmds = [" ".join(t) for b in shell_blocks(ROOT / "README.md") for t in commands(b)]
    assert "make demo" in cmds and "make test" in cmds, "README's first code block: make demo, make test"
    assert {"demo", "test"} <= make_targets()
    assert any(c.startswith("hetermoe plan") and "--cluster" in c for c in cmds), "step 1: hetermoe plan ... -- <flags>"
    assert any("pretrain_gpt.py" in c and "--hetero-plan" in c for c in cmds), "step 2: --hetero-plan"
    assert any(Path(c.split()[0]).name == "launch.sh" for c in cmds), "step 3: the SLURM script"
    assert len(text.splitlines()) <= 300, "README.md is a user's guide: at most 300 lines (docs/ has the rest)"


# ---- docs/flags.md's tables -------------------------------------------------------------------

def flag_tables() -> dict[str, set[str]]:
    """{section title: flags of its table} for every section of docs/flags.md that has a table."""
    tables: dict[str, set[str]] = {}
    title = None
    for line in FLAGS_PAGE.read_text().splitlines():
        if line.startswith("#"):
            title = line.lstrip("#").strip()
        elif line.startswith("| ") and not line.startswith("| flag") and not line.startswith("| ---"):
            first = line.split(" | ")[0]
            tables.setdefault(title, set()).update(re.findall(r"`(--?[A-Za-z][\w-]*)`", first))
    return tables


def documented_parsers() -> dict[str, set[str]]:
    """{section title in docs/flags.md: the flags its parser has} for every command."""
    want = {"`hetermoe`": options(first_parser(cli.main, ["--help"])),
            "The `--hetero-*` flags": hetero_flags(),
            "`scripts/slurm/launch.sh`": slurm_flags()}
    for name in cli.SUBCOMMANDS:
        p = first_parser(command_main(name), ["--help"])
        subs = subparsers(p)
        if options(p) - HELP or not subs:
            want[f"`hetermoe {name}`"] = options(p)
        for sub, sp in subs.items():
            want[f"`hetermoe {name} {sub}`"] = options(sp)
    want["`hetermoe bench --layer`"] = options(first_parser(command_main("bench"), ["--layer", "--help"]))
    return {k: v - HELP for k, v in want.items()}


def test_flag_tables_list_exactly_each_parsers_flags():
    tables, want = flag_tables(), documented_parsers()
    assert set(tables) == set(want), (f"docs/flags.md: sections without a parser {sorted(set(tables) - set(want))}, "
                                      f"commands without a table {sorted(set(want) - set(tables))}")
    problems = []
    for title, flags in want.items():
        if tables[title] - flags:
            problems.append(f"{title}: in the table but not in the parser: {sorted(tables[title] - flags)}")
        if flags - tables[title]:
            problems.append(f"{title}: in the parser but not in the table: {sorted(flags - tables[title])}")
    assert not problems, "docs/flags.md is out of date:\n" + "\n".join(problems)


# ---- links ------------------------------------------------------------------------------------

def anchors(page: Path) -> set[str]:
    """GitHub's anchors of a page's headings: lower case, punctuation but - and _ dropped, spaces -."""
    return {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-")
            for h in re.findall(r"^#+ (.*)$", page.read_text(), re.M)}


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_point_to_files_and_headings(page):
    missing = []
    for target in re.findall(r"\]\(([^)\s]+)\)", page.read_text()):
        if re.match(r"[a-z]+:", target):
            continue
        file, _, anchor = target.partition("#")
        path = (page.parent / file).resolve() if file else page
        if not path.exists():
            missing.append(target)
        elif anchor and path.suffix == ".md" and anchor not in anchors(path):
            missing.append(target)
    assert not missing, f"{page.relative_to(ROOT)} links to files or headings that do not exist: {missing}"
