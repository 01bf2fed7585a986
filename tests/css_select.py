"""Just enough CSS selector matching to ask the built docs which elements a rule of
docs/stylesheets/extra.css reaches (tests/test_docs.py): an HTML page parsed into a tree of elements
with their attributes (the standard library's parser), and selectors made of types, classes,
``*``, ``:not(type)``, and the descendant and child combinators. Anything else in a selector is
refused, so a rule this cannot read fails the test instead of matching nothing."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from html.parser import HTMLParser

# elements that have no end tag
VOID = {"area", "base", "br", "col", "embed", "hr", "img", "input", "link", "meta", "source", "wbr"}
COMPOUND = re.compile(r"^(\*|[a-z][a-z0-9]*)?((?:\.[\w-]+)*)((?::not\([a-z][a-z0-9]*\))*)$")


@dataclass(eq=False)
class Element:
    tag: str
    classes: set[str]
    attrs: dict[str, str] = field(default_factory=dict)
    parent: Element | None = None
    children: list[Element] = field(default_factory=list)


class _Tree(HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.root = Element("#root", set())
        self.open = self.root

    def handle_starttag(self, tag, attrs) -> None:
        attributes = {name: value or "" for name, value in attrs}
        classes = set(attributes.get("class", "").split())
        element = Element(tag, classes, attributes, self.open)
        self.open.children.append(element)
        if tag not in VOID:
            self.open = element

    def handle_endtag(self, tag) -> None:
        at = self.open
        while at is not self.root and at.tag != tag:  # close what a page left open
            at = at.parent
        if at is not self.root:
            self.open = at.parent


def parse(html: str) -> Element:
    tree = _Tree()
    tree.feed(html)
    return tree.root


def elements(root: Element):
    for child in root.children:
        yield child
        yield from elements(child)


def _compound(text: str):
    found = COMPOUND.match(text)
    if found is None:
        raise ValueError(f"css_select cannot read {text!r}")
    tag, classes, negations = found.groups()
    wanted = {c for c in classes.split(".") if c}
    excluded = set(re.findall(r":not\(([a-z0-9]+)\)", negations))

    def matches(e: Element) -> bool:
        return (
            (tag in (None, "*") or e.tag == tag)
            and wanted <= e.classes
            and e.tag not in excluded
            and e.tag != "#root"
        )

    return matches


def _matches(e: Element, parts: list[tuple[str, object]]) -> bool:
    """Whether ``e`` matches the selector's compounds read right to left, each with the combinator
    that joins it to the next one on its right."""
    (_, last), rest = parts[-1], parts[:-1]
    if not last(e):
        return False
    if not rest:
        return True
    combinator = parts[-1][0]
    at = e.parent
    while at is not None:
        if _matches(at, rest):
            return True
        if combinator == ">":
            return False
        at = at.parent
    return False


def select(root: Element, selector: str) -> list[Element]:
    tokens = selector.replace(">", " > ").split()
    parts, combinator = [], " "
    for token in tokens:
        if token == ">":
            combinator = ">"
            continue
        parts.append((combinator, _compound(token)))
        combinator = " "
    return [e for e in elements(root) if _matches(e, parts)]
