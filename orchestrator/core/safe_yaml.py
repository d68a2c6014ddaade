"""Safe YAML loading for configuration files and override values.

Basic flow: text → size check → compose a node graph (`yaml.SafeLoader`
subclass that counts alias events and limits nesting while composing) → walk
the node graph once (tags must be ones `yaml.safe_load` knows, no duplicate
mapping keys, no recursive aliases, a bound on the nodes the document expands
to) → construct plain Python values with SafeLoader's constructors.

Invariants:
  - Only `yaml.safe_load` value types come out (dict, list, str, int, float,
    bool, None, plus SafeLoader's dates/bytes/sets). A `!!python/...` tag or any
    unknown tag is rejected before anything is constructed, so it never runs.
  - Limits (bytes, alias events, expanded nodes, depth) are checked before the
    document is turned into Python objects, so an alias bomb costs nothing.
  - Every error is a `YamlError` (a `ValueError`) whose one-line message names
    the source, line:column, the key path when known, and the rule broken.

One deliberate difference from PyYAML's YAML 1.1 resolver: exponent floats
without a dot or a signed exponent (`3e-3`, `1e5`, `2E+4`) load as floats, as
in YAML 1.2 and JSON. Plain PyYAML reads them as strings, which turns a
learning rate written `3e-3` into the string "3e-3".

Example:
    >>> safe_load_text("a: {b: [1, 2]}\\nlr: 3e-3")
    {'a': {'b': [1, 2]}, 'lr': 0.003}
    >>> safe_load_value("[0, 2]")
    [0, 2]
"""
from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

import yaml
from yaml.constructor import SafeConstructor
from yaml.nodes import MappingNode, Node, ScalarNode, SequenceNode

__all__ = ["YamlError", "SafeConfigLoader", "safe_load_text", "safe_load_file", "safe_load_value"]

DEFAULT_MAX_BYTES = 1_000_000
DEFAULT_MAX_ALIASES = 100
DEFAULT_MAX_DEPTH = 50
DEFAULT_MAX_NODES = 100_000

_MERGE_TAG = "tag:yaml.org,2002:merge"
_ALLOWED_TAGS = frozenset([_MERGE_TAG, *(t for t in SafeConstructor.yaml_constructors if t is not None)])


class YamlError(ValueError):
    """A YAML document that is malformed, unsafe or over a limit (one line per problem)."""


def _where(source: str, mark) -> str:
    if mark is None:
        return source
    return f"{source}:{mark.line + 1}:{mark.column + 1}"


def _path_str(path: tuple) -> str:
    out = ""
    for p in path:
        out += f"[{p}]" if isinstance(p, int) else (f".{p}" if out else str(p))
    return out


class SafeConfigLoader(yaml.SafeLoader):
    """`yaml.SafeLoader` with limits on alias events and composing depth.

    Use through `safe_load_text`; the limits are set per instance there.
    """

    max_aliases = DEFAULT_MAX_ALIASES
    max_depth = DEFAULT_MAX_DEPTH
    source = "<string>"

    def __init__(self, stream):
        super().__init__(stream)
        self._alias_events = 0
        self._depth = 0

    def compose_node(self, parent, index):  # noqa: D401 (PyYAML hook)
        if self.check_event(yaml.AliasEvent):
            self._alias_events += 1
            if self._alias_events > self.max_aliases:
                mark = self.peek_event().start_mark
                raise YamlError(f"{_where(self.source, mark)}: more than {self.max_aliases} alias "
                                f"references (*name); limit max_aliases={self.max_aliases}")
            return super().compose_node(parent, index)
        self._depth += 1
        try:
            if self._depth > self.max_depth:
                mark = self.peek_event().start_mark
                raise YamlError(f"{_where(self.source, mark)}: nesting deeper than {self.max_depth} "
                                f"levels; limit max_depth={self.max_depth}")
            return super().compose_node(parent, index)
        finally:
            self._depth -= 1


# YAML 1.2 / JSON exponent floats that YAML 1.1 leaves as strings (see module doc).
SafeConfigLoader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(?:[0-9][0-9_]*(?:\.[0-9_]*)?|\.[0-9_]+)[eE][-+]?[0-9]+$"),
    list("-+0123456789."),
)


class _Walker:
    """One pass over the composed node graph: tags, duplicate keys, cycles, size, depth."""

    def __init__(self, loader: SafeConfigLoader, max_nodes: int, max_depth: int):
        self.loader = loader
        self.max_nodes = max_nodes
        self.max_depth = max_depth
        self.memo: dict[int, tuple[int, int]] = {}  # id(node) -> (expanded nodes, expanded depth)
        self.active: set[int] = set()

    def fail(self, node: Node, path: tuple, rule: str):
        key = f" {_path_str(path)}:" if path else ""
        raise YamlError(f"{_where(self.loader.source, node.start_mark)}:{key} {rule}")

    def walk(self, node: Node, path: tuple = ()) -> tuple[int, int]:
        nid = id(node)
        if nid in self.memo:
            return self.memo[nid]
        if nid in self.active:
            self.fail(node, path, "recursive alias (a node that contains itself) is not allowed")
        if node.tag not in _ALLOWED_TAGS:
            self.fail(node, path, f"tag {node.tag!r} is not allowed; only plain YAML values "
                                  "(mappings, lists, strings, numbers, booleans, null) are accepted")
        self.active.add(nid)
        size, depth = 1, 1
        if isinstance(node, SequenceNode):
            for i, child in enumerate(node.value):
                s, d = self.walk(child, path + (i,))
                size, depth = size + s, max(depth, d + 1)
        elif isinstance(node, MappingNode):
            seen: dict[Any, Any] = {}
            for key_node, value_node in node.value:
                ks, kd = self.walk(key_node, path + ("<key>",))
                if key_node.tag != _MERGE_TAG and isinstance(key_node, ScalarNode):
                    key = self.loader.construct_object(key_node, deep=True)
                    try:
                        if key in seen:
                            first = seen[key]
                            self.fail(key_node, path + (key,),
                                      f"duplicate key {key!r} (first at line {first.line + 1}); "
                                      "each key may appear once per mapping")
                        seen[key] = key_node.start_mark
                    except TypeError:
                        pass  # unhashable key: SafeLoader rejects it when constructing
                    label = key
                else:
                    label = "<<" if key_node.tag == _MERGE_TAG else "<key>"
                vs, vd = self.walk(value_node, path + (label,))
                size, depth = size + ks + vs, max(depth, kd + 1, vd + 1)
        self.active.discard(nid)
        if size > self.max_nodes:
            self.fail(node, path, f"document expands to more than {self.max_nodes} nodes "
                                  f"(alias bomb?); limit max_nodes={self.max_nodes}")
        if depth > self.max_depth:
            self.fail(node, path, f"nesting deeper than {self.max_depth} levels once aliases are "
                                  f"expanded; limit max_depth={self.max_depth}")
        self.memo[nid] = (size, depth)
        return size, depth


def _load(text: str | bytes, source: str, max_bytes: int, max_aliases: int, max_depth: int,
          max_nodes: int) -> Any:
    size = len(text.encode("utf-8", "surrogatepass") if isinstance(text, str) else text)
    if size > max_bytes:
        raise YamlError(f"{source}: {size} bytes is over the limit of {max_bytes} bytes (max_bytes)")
    loader = None
    try:
        loader = SafeConfigLoader(text)   # (its reader already decodes and checks the first characters)
        loader.source, loader.max_aliases, loader.max_depth = source, max_aliases, max_depth
        node = loader.get_single_node()
        if node is None:
            return None
        _Walker(loader, max_nodes, max_depth).walk(node)
        return loader.construct_document(node)
    except YamlError:
        raise
    except yaml.reader.ReaderError as e:   # a control character or invalid UTF-8: say where
        raise YamlError(f"{_reader_where(source, text, e)}: invalid YAML: "
                        f"{_reader_problem(e)}") from None
    except yaml.MarkedYAMLError as e:
        mark = e.problem_mark or e.context_mark
        what = " ".join(x for x in (e.context, e.problem) if x)
        raise YamlError(f"{_where(source, mark)}: invalid YAML: {what}") from None
    except yaml.YAMLError as e:
        raise YamlError(f"{source}: invalid YAML: {' '.join(str(e).split())}") from None
    except (ValueError, TypeError, RecursionError) as e:  # e.g. an int with too many digits
        raise YamlError(f"{source}: invalid YAML value: {' '.join(str(e).split())}") from None
    finally:
        if loader is not None:
            loader.dispose()


def _reader_where(source: str, text: str | bytes, e: "yaml.reader.ReaderError") -> str:
    """`source:line:column` (1-based) of a reader error (a character offset in the decoded text,
    or a byte offset when decoding failed)."""
    if isinstance(text, bytes) and e.encoding == "unicode":
        text = text.decode("utf-8", "replace").lstrip("\ufeff")
    head = text[:e.position]
    nl = b"\n" if isinstance(head, bytes) else "\n"
    line = head.count(nl) + 1
    column = e.position - (head.rfind(nl) + 1) + 1
    return f"{source}:{line}:{column}"


def _reader_problem(e: "yaml.reader.ReaderError") -> str:
    if e.encoding != "unicode":
        return f"invalid {e.encoding} (byte 0x{e.character:02x}); YAML files must be UTF-8 text"
    return (f"control character U+{e.character:04X} is not allowed in YAML; remove it (or, if it "
            "is meant, write it as an escape such as \\x07 inside a double-quoted string)")


def safe_load_value(text: str, *, source: str = "<value>", max_bytes: int = DEFAULT_MAX_BYTES,
                    max_aliases: int = DEFAULT_MAX_ALIASES, max_depth: int = DEFAULT_MAX_DEPTH,
                    max_nodes: int = DEFAULT_MAX_NODES) -> Any:
    """Load any YAML value safely (used for `key=value` overrides); the empty string is None.

    Example:
        >>> safe_load_value("null") is None, safe_load_value("3"), safe_load_value("'3'")
        (True, 3, '3')
    """
    return _load(text, source, max_bytes, max_aliases, max_depth, max_nodes)


def safe_load_text(text: str | bytes, *, source: str = "<string>", max_bytes: int = DEFAULT_MAX_BYTES,
                   max_aliases: int = DEFAULT_MAX_ALIASES, max_depth: int = DEFAULT_MAX_DEPTH,
                   max_nodes: int = DEFAULT_MAX_NODES) -> dict:
    """Load a YAML document whose top level must be a mapping.

    Raises:
      YamlError: malformed YAML, a disallowed tag, a duplicate key, or a limit passed.

    Example:
        >>> safe_load_text("run: {name: demo}")
        {'run': {'name': 'demo'}}
    """
    data = _load(text, source, max_bytes, max_aliases, max_depth, max_nodes)
    if not isinstance(data, dict):
        kind = "an empty document" if data is None else f"a {type(data).__name__}"
        raise YamlError(f"{source}: top level is {kind}; it must be a mapping of keys to values")
    return data


def safe_load_file(path: str | os.PathLike, *, max_bytes: int = DEFAULT_MAX_BYTES,
                   max_aliases: int = DEFAULT_MAX_ALIASES, max_depth: int = DEFAULT_MAX_DEPTH,
                   max_nodes: int = DEFAULT_MAX_NODES) -> dict:
    """Read a YAML file (size checked before reading) and load it with `safe_load_text`."""
    p = Path(path)
    source = str(path)
    try:
        if not p.is_file():
            raise YamlError(f"{source}: file not found (or not a regular file)")
        size = p.stat().st_size
        if size > max_bytes:
            raise YamlError(f"{source}: {size} bytes is over the limit of {max_bytes} bytes (max_bytes)")
        with open(p, "rb") as f:
            data = f.read(max_bytes + 1)
    except OSError as e:
        raise YamlError(f"{source}: cannot read: {e.strerror or e}") from None
    return safe_load_text(data, source=source, max_bytes=max_bytes, max_aliases=max_aliases,
                          max_depth=max_depth, max_nodes=max_nodes)
