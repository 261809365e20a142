#!/usr/bin/env python
"""Write docs/configuration-reference.md from the config schema: every key, its type, default and meaning.

    .venv/bin/python scripts/tools/gen_config_reference.py           # rewrite the page
    .venv/bin/python scripts/tools/gen_config_reference.py --check   # exit 1 if the committed page is out of date

The keys, types and defaults are elasticflow/config/schema.py's dataclasses; the meanings are the comments beside
and above their fields, read by elasticflow/config/help.py as `elasticflow train --help` reads them; the
group choices are conf/'s files. So the page cannot drift from the schema: tests/test_docs.py fails when the
committed page differs from what this script writes. To change a meaning, edit the comment in config/schema.py and
run the script.
"""
from __future__ import annotations

import ast
import dataclasses
import inspect
import io
import json
import sys
import tokenize
import typing
from pathlib import Path
from typing import Any, Dict, Iterator, List, Tuple

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from omegaconf import MISSING, OmegaConf  # noqa: E402

from elasticflow.config import schema as config, help as confighelp  # noqa: E402

PAGE = ROOT / "docs" / "configuration-reference.md"
CONF = ROOT / "conf"


def item_meanings(cls: type, prefix: str) -> Dict[str, confighelp.Meaning]:
    """The meanings of a list item's fields (``optimizer.groups[].lr``), keyed as ``prefix + field``.

    confighelp.meanings() walks fields whose type is a dataclass, not the items of a list of them (its keys
    are the composed config's, where a list holds no keys), so the item class's comments are read here,
    by the same rule: the comment after a field, and the comment lines just above it."""
    lines, _ = inspect.getsourcelines(cls)
    source = "".join(lines)
    comments: Dict[int, str] = {}
    code = set()
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT:
            comments[tok.start[0]] = tok.string.lstrip("#").strip()
        elif tok.type not in (tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT, tokenize.ENDMARKER):
            code.update(range(tok.start[0], tok.end[0] + 1))
    out = {}
    for node in ast.parse(source).body[0].body:
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            above, line = [], node.lineno - 1
            while line in comments and line not in code:
                above.insert(0, comments[line])
                line -= 1
            trailing = " ".join(comments[n] for n in range(node.lineno, node.end_lineno + 1) if n in comments)
            out[prefix + node.target.id] = confighelp.Meaning(above, trailing)
    return out


def type_name(tp: Any) -> str:
    """A field's type as a reader of YAML says it: ``int or null``, ``list of str``."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is typing.Union and type(None) in args:
        rest = [a for a in args if a is not type(None)]
        return f"{type_name(rest[0])} or null"
    if origin in (list, List):
        return "list of mappings" if dataclasses.is_dataclass(args[0]) else f"list of {type_name(args[0])}"
    if dataclasses.is_dataclass(tp):
        return "mapping"
    if tp is typing.Any:
        return "mapping (free-form)"
    return getattr(tp, "__name__", str(tp))


def default_of(f: dataclasses.Field) -> str:
    """The field's default as the reference shows it: ``required`` for MISSING, nothing for a section."""
    if f.default is MISSING or (f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING):
        return "required"
    value = f.default_factory() if f.default is dataclasses.MISSING else f.default
    if dataclasses.is_dataclass(value):
        return ""
    return yaml_value(value)


def yaml_value(value: Any) -> str:
    """``value`` as one would write it in YAML or on the command line, as inline code."""
    if value is None:
        return "`null`"
    if isinstance(value, bool):
        return f"`{str(value).lower()}`"
    if isinstance(value, (list, dict)):
        return f"`{json.dumps(value)}`"
    return f"`{value}`"


def escape(text: str) -> str:
    """Comment text as Markdown table-cell text: no accidental emphasis, HTML or cell breaks; the parts
    the comment itself quotes in backticks stay code."""
    parts = text.split("`")
    for i, part in enumerate(parts):
        for ch in ("\\*_|" if i % 2 == 0 else "|"):  # a pipe would end the cell even inside code
            part = part.replace(ch, "\\" + ch)
        parts[i] = part.replace("<", "&lt;") if i % 2 == 0 else part
    return "`".join(parts)


Row = Tuple[str, str, str, str]  # key, type, default, meaning


def entries(cls: type, prefix: str, found: Dict[str, confighelp.Meaning]) -> Iterator[Tuple[str, Any]]:
    """``cls``'s keys in schema order, as ("row", Row) and ("heading", text): a comment block above a field
    that also has its own trailing comment heads the fields below it (``# SLURM (launcher=slurm): ...``)."""
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        key, tp = prefix + f.name, hints[f.name]
        meaning = found.get(key)
        if meaning is None or not (meaning.above or meaning.trailing):
            raise SystemExit(f"config key {key} has no comment in elasticflow/config/schema.py: add `# what it means` "
                             "after the field (or comment lines above it)")
        if meaning.above and meaning.trailing:
            yield "heading", " ".join(meaning.above)
            text = meaning.trailing
        else:
            text = " ".join(meaning.above + ([meaning.trailing] if meaning.trailing else []))
        yield "row", (key, type_name(tp), default_of(f), escape(text))
        item = typing.get_args(tp)[0] if typing.get_origin(tp) in (list, List) else None
        if dataclasses.is_dataclass(tp):
            yield from entries(tp, key + ".", found)
        elif item is not None and dataclasses.is_dataclass(item):
            yield from entries(item, key + "[].", {**found, **item_meanings(item, key + "[].")})


def table(rows: List[Row]) -> List[str]:
    lines = ["| key | type | default | meaning |", "|---|---|---|---|"]
    lines += [f"| `{key}` | {tp} | {default} | {meaning} |" for key, tp, default, meaning in rows]
    return lines


def groups() -> List[str]:
    """The config groups (conf/<group>/<choice>.yaml): each choice and the values it sets that differ from
    the schema's defaults."""
    defaults = {}
    for entry in OmegaConf.load(CONF / "config.yaml").defaults:
        if isinstance(entry, dict) or OmegaConf.is_dict(entry):
            defaults.update({str(k): str(v) for k, v in entry.items()})
    schema = OmegaConf.structured(config.Config)
    lines = ["| group | choice | sets (where it differs from the defaults below) |", "|---|---|---|"]
    for group in sorted(p.name for p in CONF.iterdir() if p.is_dir()):
        for path in sorted((CONF / group).glob("*.yaml")):
            text = path.read_text()
            node = OmegaConf.load(path)
            if "# @package _global_" not in text:
                node = OmegaConf.create({group: node})
            sets = []
            for key, value in flatten(OmegaConf.to_container(node)):
                known = OmegaConf.select(schema, key, default=None, throw_on_missing=False)
                if key.endswith(".name") or known != value:
                    sets.append(f"`{key}={yaml_value(value).strip('`')}`")
            choice = f"`{group}={path.stem}`" + (" (default)" if defaults.get(group) == path.stem else "")
            lines.append(f"| `{group}` | {choice} | {', '.join(sets) or '(nothing)'} |")
    return lines


def flatten(node: Any, prefix: str = "") -> List[Tuple[str, Any]]:
    """[(dotted key, leaf value)] of a nested dict."""
    if isinstance(node, dict):
        return [kv for k, v in node.items() for kv in flatten(v, f"{prefix}{k}.")]
    return [(prefix[:-1], node)]


def render() -> str:
    found = confighelp.meanings()
    everything = list(entries(config.Config, "", found))
    sections = {row[0] for kind, row in everything if kind == "row" and "." not in row[0] and row[1] == "mapping"}
    top = [row for kind, row in everything if kind == "row" and row[0] not in sections and "." not in row[0]]
    lines = [
        "<!-- Generated by scripts/tools/gen_config_reference.py from elasticflow/config/schema.py and conf/:"
        " do not edit. Change a meaning in config/schema.py's comments, then run the script. -->",
        "",
        "# Configuration reference",
        "",
        "Every key of the schema (`elasticflow/config/schema.py`), with its type, its default and what it means.",
        "Set any of them on the command line as `key=value` (a list as `key=[a,b]`, null as `key=null`);",
        "[Configuration](configuration.md) explains how composition, errors and sweeps work.",
        "`elasticflow train --help` prints the same meanings beside the composed config.",
        "",
        "## Config groups",
        "",
        "A group picks a file from `conf/` (`optimizer=adamw`); the keys below then start from the values it sets.",
        "",
        *groups(),
        "",
        "## Top-level keys",
        "",
        *table(top),
    ]
    in_table = False
    for kind, value in everything:
        if kind == "row" and value[0] in sections:  # a section: its meaning introduces its table
            intro = value[3][:1].upper() + value[3][1:]
            lines += ["", f"## {value[0]}", "", intro if intro.endswith(".") else intro + "."]
            in_table = False
        elif kind == "heading":
            lines += ["", f"**{escape(value)}**"]
            in_table = False
        elif "." in value[0]:
            if not in_table:
                lines += ["", *table([])]
                in_table = True
            lines.append(table([value])[2])
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    text = render()
    if "--check" in sys.argv[1:]:
        if not PAGE.exists() or PAGE.read_text() != text:
            sys.exit(f"{PAGE.relative_to(ROOT)} is out of date: "
                     "run .venv/bin/python scripts/tools/gen_config_reference.py")
        sys.exit(0)
    PAGE.write_text(text)
    print(f"wrote {PAGE.relative_to(ROOT)}")
