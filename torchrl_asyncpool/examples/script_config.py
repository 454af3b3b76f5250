"""A training script's ``Config`` dataclass as command-line flags (``total_frames`` -> ``--total-frames``).

The help of each flag is the trailing comment of its field in the script's ``Config`` block
(with the indented comment lines under it), followed by its default; booleans take
``true``/``false``. The script keeps its own checks of the values (``parser.error(...)``).
"""
from __future__ import annotations

import argparse
import dataclasses
import re

__all__ = ["parse_bool", "field_help", "config_parser"]


def parse_bool(s: str) -> bool:
    """``true``/``false`` (also ``1``/``0``, ``yes``/``no``, ``on``/``off``, any case)."""
    if s.lower() in ("1", "true", "yes", "on"):
        return True
    if s.lower() in ("0", "false", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected true or false, got {s!r}")


def field_help(script_path: str) -> dict:
    """Each field's trailing comment (with its indented continuation lines) in the ``Config``
    block of the script at ``script_path``."""
    with open(script_path) as f:
        source = f.read().split("\nclass Config:\n", 1)[1].split("\n\n", 1)[0]
    out, last = {}, None
    for line in source.splitlines():
        field = re.match(r"    (\w+): [^=]+= .*?(?:#\s*(.*))?$", line)
        if field:
            last = field.group(1)
            out[last] = field.group(2) or ""
        elif last and re.match(r"\s{8,}#", line):  # a continuation, aligned under the comment
            out[last] += " " + line.split("#", 1)[1].strip()
        else:
            last = None
    return out


def config_parser(config_cls, script_path: str, description: str | None) -> argparse.ArgumentParser:
    """A parser with one flag per field of ``config_cls`` (a dataclass defined in the script at
    ``script_path``), documented by :func:`field_help`; ``description`` is the script's docstring."""
    parser = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    helps = field_help(script_path)
    for f in dataclasses.fields(config_cls):
        flag = "--" + f.name.replace("_", "-")
        default = "" if f.default == "" else f" (default: {f.default})"  # "": the comment says what it means
        text = (helps.get(f.name, "") + default).strip()
        if f.type in ("bool", bool):
            parser.add_argument(flag, type=parse_bool, default=f.default, metavar="BOOL", help=text)
        else:
            typ = {"int": int, "float": float, "str": str}[f.type] if isinstance(f.type, str) else f.type
            parser.add_argument(flag, type=typ, default=f.default, help=text)
    return parser
