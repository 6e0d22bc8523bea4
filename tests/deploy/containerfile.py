"""deploy/image/Containerfile read as a builder reads it: instructions (continuation lines joined, comments
dropped) grouped into stages, with what the final stage says the image runs as (USER, WORKDIR, ENV, CMD,
ENTRYPOINT), and the packages each stage installs with apt-get and pip. Enough of the format for the checks in
test_image.py, not a general parser (no heredocs, no escape directive, no JSON-form RUN)."""

from __future__ import annotations

import json
import re
import shlex
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
CONTAINERFILE = ROOT / "deploy" / "image" / "Containerfile"


@dataclass(frozen=True)
class Instruction:
    keyword: str  # upper case: FROM, RUN, COPY, ENV, ...
    args: str


@dataclass
class Stage:
    base: str
    name: str | None
    instructions: list[Instruction] = field(default_factory=list)

    def all(self, keyword: str) -> list[str]:
        return [i.args for i in self.instructions if i.keyword == keyword]

    def last(self, keyword: str) -> str | None:
        found = self.all(keyword)
        return found[-1] if found else None

    @property
    def env(self) -> dict[str, str]:
        """ENV as set by this stage (`KEY=value ...` form; values with spaces quoted)."""
        out: dict[str, str] = {}
        for args in self.all("ENV"):
            for part in shlex.split(args):
                key, _, value = part.partition("=")
                out[key] = value
        return out

    def exec_form(self, keyword: str) -> list[str] | None:
        """CMD or ENTRYPOINT in JSON (exec) form; None when absent."""
        args = self.last(keyword)
        if args is None:
            return None
        value = json.loads(args)
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            raise ValueError(f"{keyword} is not in exec form: {args}")
        return value

    @property
    def apt_packages(self) -> list[str]:
        out: list[str] = []
        for run in self.all("RUN"):
            for m in re.finditer(r"apt-get\s+install\s+([^&;|>]*)", run):
                out += [w for w in shlex.split(m.group(1)) if not w.startswith("-")]
        return out

    @property
    def pip_installs(self) -> list[str]:
        """The requirements of every `pip install` in this stage (options and their values left out)."""
        out: list[str] = []
        for run in self.all("RUN"):
            for m in re.finditer(r"pip\s+install\s+([^;&|]*)", run):
                words = shlex.split(m.group(1))
                skip = False
                for w in words:
                    if skip:
                        skip = False
                    elif w in ("--find-links", "--index-url", "--extra-index-url", "-r", "-c", "--target", "$src"):
                        skip = True
                    elif not w.startswith("-") and w != "$src":
                        out.append(w)
        return out


def instructions(text: str) -> list[Instruction]:
    lines: list[str] = []
    pending = ""
    for raw in text.splitlines():
        stripped = raw.strip()
        if not pending and (not stripped or stripped.startswith("#")):
            continue
        if pending and stripped.startswith("#"):  # a comment inside a continued instruction
            continue
        if stripped.endswith("\\"):
            pending += stripped[:-1] + " "
            continue
        lines.append(pending + stripped)
        pending = ""
    out = []
    for line in lines:
        keyword, _, args = line.partition(" ")
        out.append(Instruction(keyword.upper(), args.strip()))
    return out


def stages(text: str) -> tuple[dict[str, str], list[Stage]]:
    """Global ARG defaults (before the first FROM) and the stages, with `${ARG}` in FROM resolved."""
    args: dict[str, str] = {}
    out: list[Stage] = []
    for ins in instructions(text):
        if ins.keyword == "FROM":
            words = ins.args.split()
            base = re.sub(r"\$\{(\w+)\}|\$(\w+)", lambda m: args.get(m.group(1) or m.group(2), ""), words[0])
            name = words[2] if len(words) == 3 and words[1].upper() == "AS" else None
            out.append(Stage(base, name))
        elif not out:
            if ins.keyword == "ARG":
                key, _, value = ins.args.partition("=")
                args[key] = value
        else:
            out[-1].instructions.append(ins)
    return args, out


def arg_default(stage: Stage, name: str) -> str | None:
    for args in stage.all("ARG"):
        key, _, value = args.partition("=")
        if key == name:
            return value
    return None
