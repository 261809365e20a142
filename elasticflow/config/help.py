"""What each config key means, read from the comments of the schema's dataclasses (config/schema.py), for
`elasticflow train --help`: the help is generated from the schema and cannot drift from it.

A field's meaning is its trailing comment (``lr: float = 0.1  # ...``) and the comment lines just above it
(a longer explanation, or a section's heading), as config/schema.py writes them.
"""
from __future__ import annotations

import ast
import dataclasses
import inspect
import io
import re
import tokenize
import typing
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Tuple

from . import schema as config


@dataclass
class Meaning:
    above: List[str] = field(default_factory=list)  # comment lines above the field, without "# "
    trailing: str = ""                               # the comment after it on its line(s)


def meanings() -> Dict[str, Meaning]:
    """{dotted key: Meaning} for every field reachable from ``config.Config`` (``trainer.eval_every``, ...)."""
    classes: Dict[str, Tuple[ast.ClassDef, Dict[int, str], set]] = {}
    for module in _schema_modules(config.Config):  # config/schema.py, and topology.py for TopologyConfig
        classes.update(_classes(inspect.getsource(module)))

    def fields_of(name: str, prefix: str, out: Dict[str, Meaning]) -> None:
        cls, comments, code_lines = classes[name]
        for node in cls.body:
            if not (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)):
                continue
            key = prefix + node.target.id
            above, line = [], node.lineno - 1
            while line in comments and line not in code_lines:
                above.insert(0, comments[line])
                line -= 1
            trailing = " ".join(comments[n] for n in range(node.lineno, node.end_lineno + 1) if n in comments)
            out[key] = Meaning(above, trailing)
            nested = node.annotation.id if isinstance(node.annotation, ast.Name) else None
            if nested in classes:
                fields_of(nested, key + ".", out)

    found: Dict[str, Meaning] = {}
    fields_of(config.Config.__name__, "", found)
    return found


def _schema_modules(cls: type) -> List[Any]:
    """The modules defining ``cls`` and the dataclasses its fields hold, ``cls``'s first."""
    modules, todo = [], [cls]
    while todo:
        c = todo.pop()
        module = inspect.getmodule(c)
        if module not in modules:
            modules.append(module)
        todo += [t for t in typing.get_type_hints(c).values() if dataclasses.is_dataclass(t)]
    return modules


def _classes(source: str) -> Dict[str, Tuple[ast.ClassDef, Dict[int, str], set]]:
    """{class name: (its AST, line -> comment, the lines holding code)} of the module ``source``."""
    comments: Dict[int, str] = {}  # line -> the comment on it
    code_lines = set()             # lines holding code (a comment alone on its line is not one)
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT:
            comments[tok.start[0]] = tok.string.lstrip("#").strip()
        elif tok.type not in (tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT, tokenize.ENDMARKER):
            code_lines.update(range(tok.start[0], tok.end[0] + 1))
    return {node.name: (node, comments, code_lines) for node in ast.parse(source).body
            if isinstance(node, ast.ClassDef)}


_KEY = re.compile(r"^(\s*)([A-Za-z_]\w*):( .*)?$")


def annotate(text: str, after: str = "", found: Optional[Dict[str, Meaning]] = None) -> str:
    """``text`` (the composed config as YAML, as Hydra's help prints it) with each key's meaning as YAML
    comments: the lines above it, and after it on its line. With ``after``, only the lines after the
    first line that starts with it (the help's config section; the group list above it is not config)."""
    found = meanings() if found is None else found
    out, path = [], []  # path: (indent, key) of the mappings the current line sits in
    waiting = bool(after)
    for line in text.splitlines():
        m = _KEY.match(line)
        if waiting or not m:  # before the config, a list item, or text around the config
            waiting = waiting and not line.startswith(after)
            out.append(line)
            continue
        indent, key = len(m.group(1)), m.group(2)
        while path and path[-1][0] >= indent:
            path.pop()
        dotted = ".".join([k for _, k in path] + [key])
        path.append((indent, key))
        meaning = found.get(dotted)
        if meaning is None:
            out.append(line)
            continue
        out += [f"{m.group(1)}# {c}" for c in meaning.above]
        out.append(f"{line}  # {meaning.trailing}" if meaning.trailing else line)
    return "\n".join(out)
