"""Bug injection by program transformation (libcst), SWE-smith style. Each kind of mutation has sites in a
module, counted in one deterministic traversal order; `mutate(source, kind, index)` applies one.

    flip_comparison   the first operator of a comparison: < ↔ >=, > ↔ <=, == ↔ !=, in ↔ not in, is ↔ is not
    change_constant   an integer literal n → n + 1
    swap_arguments    the first two positional arguments of a call
    remove_line       one simple statement of a block that has others (docstrings excluded)
    drop_branch       the else / elif part of an if
"""

from __future__ import annotations

import libcst as cst

KINDS = ("flip_comparison", "change_constant", "swap_arguments", "remove_line", "drop_branch")

_FLIP = {cst.LessThan: cst.GreaterThanEqual, cst.GreaterThanEqual: cst.LessThan, cst.GreaterThan: cst.LessThanEqual,
         cst.LessThanEqual: cst.GreaterThan, cst.Equal: cst.NotEqual, cst.NotEqual: cst.Equal, cst.In: cst.NotIn,
         cst.NotIn: cst.In, cst.Is: cst.IsNot, cst.IsNot: cst.Is}


class _Mutator(cst.CSTTransformer):
    """Counts the sites of every kind; mutates the `index`-th site of `kind` (none when kind is None)."""

    def __init__(self, kind: str | None = None, index: int = -1):
        self.kind, self.index = kind, index
        self.counts = dict.fromkeys(KINDS, 0)
        self.applied = False

    def _hit(self, kind: str) -> bool:
        n = self.counts[kind]
        self.counts[kind] += 1
        if kind == self.kind and n == self.index:
            self.applied = True
            return True
        return False

    def leave_Comparison(self, original, updated):
        op = updated.comparisons[0].operator
        if type(op) in _FLIP and self._hit("flip_comparison"):
            flipped = updated.comparisons[0].with_changes(operator=_FLIP[type(op)]())
            return updated.with_changes(comparisons=[flipped, *updated.comparisons[1:]])
        return updated

    def leave_Integer(self, original, updated):
        if self._hit("change_constant"):
            return updated.with_changes(value=str(int(updated.evaluated_value) + 1))
        return updated

    def leave_Call(self, original, updated):
        positional = [i for i, a in enumerate(updated.args) if a.keyword is None and not a.star]
        if len(positional) >= 2 and updated.args[positional[0]].value.deep_equals(updated.args[positional[1]].value):
            return updated  # swapping equal arguments changes nothing
        if len(positional) >= 2 and self._hit("swap_arguments"):
            args = list(updated.args)
            i, j = positional[0], positional[1]
            args[i], args[j] = (args[i].with_changes(value=updated.args[j].value),
                                args[j].with_changes(value=updated.args[i].value))
            return updated.with_changes(args=args)
        return updated

    def leave_IndentedBlock(self, original, updated):
        body = list(updated.body)
        candidates = [i for i, s in enumerate(body) if isinstance(s, cst.SimpleStatementLine) and not _is_docstring(s)]
        if len(body) < 2:
            return updated
        for i in candidates:
            if self._hit("remove_line"):
                return updated.with_changes(body=body[:i] + body[i + 1:])
        return updated

    def leave_If(self, original, updated):
        if updated.orelse is not None and self._hit("drop_branch"):
            return updated.with_changes(orelse=None)
        return updated


def _is_docstring(stmt: cst.SimpleStatementLine) -> bool:
    return (len(stmt.body) == 1 and isinstance(stmt.body[0], cst.Expr)
            and isinstance(stmt.body[0].value, (cst.SimpleString, cst.ConcatenatedString)))


def sites(source: str) -> dict[str, int]:
    """How many sites of each kind the module has."""
    counter = _Mutator()
    cst.parse_module(source).visit(counter)
    return counter.counts


def mutate(source: str, kind: str, index: int) -> str:
    """The module with the `index`-th site of `kind` mutated (formatting elsewhere kept byte for byte)."""
    if kind not in KINDS:
        raise ValueError(f"unknown mutation {kind!r}; kinds: {', '.join(KINDS)}")
    mutator = _Mutator(kind, index)
    out = cst.parse_module(source).visit(mutator).code
    if not mutator.applied:
        raise IndexError(f"the module has {mutator.counts[kind]} {kind} sites, not {index + 1}")
    return out
