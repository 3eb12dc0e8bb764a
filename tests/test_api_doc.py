"""docs/api.md covers the public surface: every name of ``osdp_fx.__all__`` has a section, every
parameter of a public function, class or method is mentioned in its section, and every option of
the command line is in its command's section. The README's example runs as written.

A section is a heading that names the object in backticks (`` `compile_osdp(` ``,
`` `Devices.preset(` ``, `` `OSDPModule` ``) and what follows it up to the next heading of the
same or a higher level. A parameter counts as mentioned when a backtick span starts with its
name (`` `plan` ``, `` `memory_limit="8GiB"` ``); a signature written whole in one span (a
heading's) does not count, so each parameter must be explained on its own.
"""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest

import osdp_fx
from osdp_fx.cli import build_parser
from osdp_fx.plan.plan import Prediction

ROOT = Path(__file__).resolve().parents[1]
API_DOC = ROOT / "docs" / "api.md"
CLASSES_WITH_METHODS = (osdp_fx.OSDPModule, osdp_fx.Plan, osdp_fx.Devices, Prediction)
"""Classes whose public methods and properties need a mention too (Prediction is what
``compiled.plan.prediction`` returns)."""


def sections(text: str) -> list[tuple[str, str]]:
    """(heading, body) of every heading of a Markdown text; the body runs to the next heading of
    the same or a higher level, so it holds the subsections."""
    lines = text.splitlines()
    heads = [(i, len(m.group(1)), m.group(2)) for i, line in enumerate(lines)
             if (m := re.match(r"(#{1,6})\s+(.*)", line))]
    out = []
    for k, (i, level, title) in enumerate(heads):
        end = next((j for j, lv, _ in heads[k + 1:] if lv <= level), len(lines))
        out.append((title, "\n".join(lines[i + 1:end])))
    return out


def section_of(text: str, qualname: str) -> str | None:
    """The body of the first section whose heading names ``qualname`` in backticks, followed by
    its parameters or the closing backtick; None when there is none."""
    pattern = re.compile(r"`" + re.escape(qualname) + r"[(`\s]")
    for title, body in sections(text):
        if pattern.search(title):
            return body
    return None


def mentioned(body: str, name: str) -> bool:
    """Whether a backtick span of ``body`` starts with ``name`` (a parameter, field, option)."""
    return re.search(r"`\**" + re.escape(name) + r"(?![\w-])", body) is not None


def parameters(obj: object) -> list[str]:
    """Names of the parameters a user passes to ``obj`` (not self/cls, not *args/**kwargs)."""
    try:
        signature = inspect.signature(obj)  # type: ignore[arg-type]
    except (TypeError, ValueError):  # exceptions: no signature of their own
        return []
    return [p.name for p in signature.parameters.values()
            if p.name not in ("self", "cls")
            and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]


def public_members(cls: type) -> dict[str, object]:
    """The methods, properties and fields ``cls`` defines itself, without a leading ``_``."""
    members = {n: v for n, v in vars(cls).items() if not n.startswith("_")}
    if dataclasses.is_dataclass(cls):
        members.update({f.name: f for f in dataclasses.fields(cls)})
    return members


def missing_from_doc(text: str) -> list[str]:
    """Every public name, parameter, method and field that docs/api.md does not mention where
    it should; empty when the page is complete."""
    missing = []
    for name in osdp_fx.__all__:
        obj = getattr(osdp_fx, name)
        body = section_of(text, name)
        if body is None:
            missing.append(f"{name}: no section whose heading names `{name}`")
            continue
        missing += [f"{name}: parameter `{p}`" for p in parameters(obj)
                    if not mentioned(body, p)]
    for cls in CLASSES_WITH_METHODS:
        body = section_of(text, cls.__name__)
        if body is None:
            missing.append(f"{cls.__name__}: no section")
            continue
        for member, value in public_members(cls).items():
            if not mentioned(body, member) and section_of(body, f"{cls.__name__}.{member}") is None:
                missing.append(f"{cls.__name__}.{member}: not mentioned in its class's section")
            function = getattr(value, "__func__", value)
            if not inspect.isfunction(function):
                continue  # properties and fields: a mention is enough
            params = parameters(function)
            method = section_of(text, f"{cls.__name__}.{member}")
            if params and method is None:
                missing.append(f"{cls.__name__}.{member}: no section whose heading names "
                               f"`{cls.__name__}.{member}(`")
                continue
            missing += [f"{cls.__name__}.{member}: parameter `{p}`" for p in params
                        if not mentioned(method or "", p)]
    return missing


def cli_options() -> dict[str, list[str]]:
    """Per subcommand of ``python -m osdp_fx``, what names each of its arguments: the long
    option (``--world-size``), or the metavar (else the name) of a positional argument."""
    parser = build_parser()
    commands = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    options: dict[str, list[str]] = {}
    for command, sub in commands.choices.items():
        names = []
        for action in sub._actions:
            if isinstance(action, argparse._HelpAction):
                continue
            if action.option_strings:
                names.append(max(action.option_strings, key=len))
            else:
                names.append(action.metavar or action.dest)
        options[command] = names
    return options


def missing_cli_options(text: str) -> list[str]:
    missing = []
    for command, names in cli_options().items():
        body = section_of(text, f"python -m osdp_fx {command}")
        if body is None:
            missing.append(f"{command}: no section whose heading names `python -m osdp_fx "
                           f"{command}`")
            continue
        missing += [f"python -m osdp_fx {command}: {name}" for name in names
                    if not mentioned(body, name)]
    return missing


@pytest.fixture(scope="module")
def api_doc() -> str:
    return API_DOC.read_text()


def test_every_public_name_and_parameter_is_documented(api_doc):
    assert not missing_from_doc(api_doc), "docs/api.md lacks:\n" + "\n".join(
        missing_from_doc(api_doc))


def test_every_command_line_option_is_documented(api_doc):
    assert not missing_cli_options(api_doc), "docs/api.md lacks:\n" + "\n".join(
        missing_cli_options(api_doc))


def test_the_check_fails_when_a_parameter_or_option_is_missing(api_doc):
    """The checks above can fail: drop one parameter's, one method's and one option's mentions
    and each is reported."""
    body = section_of(api_doc, "compile_osdp")
    assert body is not None and mentioned(body, "grad_accumulation")
    without_param = api_doc.replace("`grad_accumulation`", "grad_accumulation")
    assert "compile_osdp: parameter `grad_accumulation`" in missing_from_doc(without_param)

    without_method = re.sub(r"### `Plan\.explain\(name\)`.*?(?=\n#)", "", api_doc, flags=re.S)
    assert any(m.startswith("Plan.explain") for m in missing_from_doc(without_method))

    without_option = api_doc.replace("`--no-recompute`", "no-recompute")
    assert "python -m osdp_fx plan: --no-recompute" in missing_cli_options(without_option)


def test_section_and_mention_rules():
    text = ("# A\n## `f(x, y=1)`\n- `x`: one\n- y: none\n### `C.m(a)`\n`a=2`\n## `g`\n`y`\n")
    assert section_of(text, "f").startswith("- `x`")
    assert "`a=2`" in section_of(text, "f")  # subsections belong to the section
    assert section_of(text, "C.m") == "`a=2`"
    assert mentioned(section_of(text, "f"), "x") and mentioned(section_of(text, "C.m"), "a")
    assert not mentioned(section_of(text, "f"), "y")  # only in the heading's whole signature
    assert not mentioned("`max_norm`", "max")  # a prefix of another name is not a mention
    assert section_of(text, "h") is None


def readme_example() -> str:
    """The README's Python example, as a user copies it."""
    text = (ROOT / "README.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", text, flags=re.S)
    assert len(blocks) == 1, "the README should hold one Python example"
    return blocks[0]


def test_the_readme_example_runs_and_resumes_as_written(tmp_path):
    """``torchrun --nproc_per_node 2 train.py`` twice: the first run trains 100 steps and saves a
    checkpoint, the second resumes from it (its plan from the plan cache) and trains 100 more."""
    (tmp_path / "train.py").write_text(readme_example())
    env = {**os.environ, "OSDP_FX_PLAN_CACHE": str(tmp_path / "plan-cache"),
           "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    for steps in (100, 200):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        proc = subprocess.run(
            [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
             "--master_addr", "127.0.0.1", "--master_port", str(port), "train.py"],
            cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
            timeout=300, check=False)
        assert proc.returncode == 0, proc.stdout[-6000:]
        assert f"after step {steps}: loss" in proc.stdout, proc.stdout[-3000:]
        assert "Plan for world size 2" in proc.stdout


def test_every_module_path_the_docs_name_exists():
    """Every ``osdp_fx/<path>.py`` README.md and docs/*.md mention is a file (a module that moved,
    ``osdp_fx/presets.py`` to ``osdp_fx/core/presets.py``, leaves no stale path behind)."""
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    named = {(page.name, path) for page in pages
             for path in re.findall(r"osdp_fx/[\w/]+\.py", page.read_text())}
    assert len(named) > 5  # the check sees the paths
    missing = sorted(f"{page}: {path}" for page, path in named if not (ROOT / path).is_file())
    assert not missing, "\n".join(missing)
