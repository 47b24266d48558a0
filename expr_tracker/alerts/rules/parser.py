"""Parser of rule conditions: tokens -> a checked AST, plus the two ways to print it back.

Precedence, loosest first: `or`, `and`, `not`, comparisons (not chainable), `+ -`,
`* / %`, unary minus, atoms. Every node is either a number or a condition (true/false);
a number used as a condition is true when non-zero and a condition used as a number is
1/0, but the whole rule condition must be a condition.
"""

from __future__ import annotations

import difflib

from expr_tracker.alerts.rules.lexer import DUR, END, NAME, NUM, OP, QNAME, Token, fail, tokenize

AGGREGATES = ("mean", "std", "var", "median", "sum", "min", "max", "first", "last", "count")
WINDOW_FUNCS = ("slope", "zscore", "ema", "increasing", "decreasing", "stalled")
METRIC_FUNCS = ("diff", "rate", "pct_change", "isnan", "isinf", "has", "age")
MATH_FUNCS = ("abs", "log", "exp", "sqrt", "floor", "ceil")
NULLARY_FUNCS = ("step", "elapsed")
DURATION_FUNCS = ("no_data",)
FUNCTIONS = frozenset(
    AGGREGATES + WINDOW_FUNCS + METRIC_FUNCS + MATH_FUNCS + NULLARY_FUNCS + DURATION_FUNCS
)
BOOL_FUNCS = frozenset(("increasing", "decreasing", "stalled", "isnan", "isinf", "has", "no_data"))
TIME_FUNCS = frozenset(("no_data", "age", "elapsed"))
# Rules using these are evaluated on every row, not only on rows carrying one of their metrics.
EVERY_ROW_FUNCS = frozenset(("has", "elapsed", "age", "no_data"))
POINT_WINDOW_ONLY = frozenset(("ema",))
MAX_WINDOW_POINTS = 1_000_000
MAX_DEPTH = 60  # nested parentheses, calls and prefix operators
MAX_TREE_DEPTH = 100  # of the finished tree, so printing and evaluating it never recurse far

COMPARISONS = ("<", "<=", ">", ">=", "==", "!=")
_PREC = {"or": 1, "and": 2, "not": 3, "<": 4, "<=": 4, ">": 4, ">=": 4, "==": 4, "!=": 4,
         "+": 5, "-": 5, "*": 6, "/": 6, "%": 6}
_UNARY_MINUS_PREC = 7
_ATOM_PREC = 8


class Node:
    """Base of AST nodes; `pos` is the 0-based offset of the node's first character."""

    # Plain slotted classes, not dataclasses: they keep `import expr_tracker.alerts.rules` cheap.
    __slots__ = ("pos",)

    def __init__(self, pos: int) -> None:
        self.pos = pos


class Num(Node):
    __slots__ = ("is_duration", "text", "value")

    def __init__(self, pos: int, value: float, text: str, is_duration: bool = False) -> None:
        super().__init__(pos)
        self.value = value
        self.text = text
        self.is_duration = is_duration


class Metric(Node):
    __slots__ = ("name", "points", "quoted", "seconds", "window_text")

    def __init__(self, pos: int, name: str, quoted: bool = False) -> None:
        super().__init__(pos)
        self.name = name
        self.quoted = quoted
        self.points: int | None = None  # window of the last N points
        self.seconds: float | None = None  # window of the last N seconds of record time
        self.window_text = ""

    @property
    def windowed(self) -> bool:
        return self.points is not None or self.seconds is not None


class Call(Node):
    __slots__ = ("args", "name")

    def __init__(self, pos: int, name: str) -> None:
        super().__init__(pos)
        self.name = name
        self.args: list[Node] = []


class Unary(Node):
    __slots__ = ("op", "operand")

    def __init__(self, pos: int, op: str, operand: Node) -> None:
        super().__init__(pos)
        self.op = op  # "-" or "not"
        self.operand = operand


class Binary(Node):
    __slots__ = ("left", "op", "op_pos", "right")

    def __init__(self, pos: int, op: str, left: Node, right: Node, op_pos: int = 0) -> None:
        super().__init__(pos)
        self.op = op
        self.left = left
        self.right = right
        self.op_pos = op_pos


def is_bool(node: Node) -> bool:
    """True when `node` yields a condition rather than a number."""
    if isinstance(node, Binary):
        return node.op in _PREC and _PREC[node.op] <= 4
    if isinstance(node, Unary):
        return node.op == "not"
    return isinstance(node, Call) and node.name in BOOL_FUNCS


class _Parser:
    def __init__(self, text: str, start: int, end: int, label: str | None) -> None:
        self.text = text
        self.label = label
        self.toks = tokenize(text, start, end)
        self.i = 0
        self.depth = 0

    def error(self, pos: int, message: str) -> None:
        fail(self.text, pos, message, self.label)

    @property
    def tok(self) -> Token:
        return self.toks[self.i]

    def unexpected(self) -> None:
        tok = self.tok
        if tok.kind == END:
            self.error(tok.pos, "unexpected end of condition")
        self.error(tok.pos, f"unexpected {tok.raw or tok.text!r}")

    def take(self, op: str) -> bool:
        tok = self.tok
        if tok.kind == OP and tok.text == op:
            self.i += 1
            return True
        return False

    def nest(self, pos: int) -> None:
        self.depth += 1
        if self.depth > MAX_DEPTH:
            self.error(pos, f"expression nested more than {MAX_DEPTH} levels deep")

    def parse(self) -> Node:
        if self.tok.kind == END:
            self.error(self.tok.pos, "empty condition")
        node = self.parse_or()
        if self.tok.kind != END:
            self.unexpected()
        return node

    def parse_or(self) -> Node:
        node = self.parse_and()
        while self.tok.kind == OP and self.tok.text == "or":
            op_pos = self.tok.pos
            self.i += 1
            node = Binary(node.pos, "or", node, self.parse_and(), op_pos)
        return node

    def parse_and(self) -> Node:
        node = self.parse_not()
        while self.tok.kind == OP and self.tok.text == "and":
            op_pos = self.tok.pos
            self.i += 1
            node = Binary(node.pos, "and", node, self.parse_not(), op_pos)
        return node

    def parse_not(self) -> Node:
        tok = self.tok
        if tok.kind == OP and tok.text == "not":
            self.i += 1
            self.nest(tok.pos)
            node = Unary(tok.pos, "not", self.parse_not())
            self.depth -= 1
            return node
        return self.parse_cmp()

    def parse_cmp(self) -> Node:
        node = self.parse_add()
        tok = self.tok
        if tok.kind == OP and tok.text in COMPARISONS:
            self.i += 1
            node = Binary(node.pos, tok.text, node, self.parse_add(), tok.pos)
            nxt = self.tok
            if nxt.kind == OP and nxt.text in COMPARISONS:
                self.error(nxt.pos, "comparisons do not chain; write 'a < b and b < c'")
        return node

    def parse_add(self) -> Node:
        node = self.parse_mul()
        while self.tok.kind == OP and self.tok.text in ("+", "-"):
            tok = self.tok
            self.i += 1
            node = Binary(node.pos, tok.text, node, self.parse_mul(), tok.pos)
        return node

    def parse_mul(self) -> Node:
        node = self.parse_unary()
        while self.tok.kind == OP and self.tok.text in ("*", "/", "%"):
            tok = self.tok
            self.i += 1
            node = Binary(node.pos, tok.text, node, self.parse_unary(), tok.pos)
        return node

    def parse_unary(self) -> Node:
        tok = self.tok
        if tok.kind == OP and tok.text == "-":
            self.i += 1
            self.nest(tok.pos)
            node: Node = Unary(tok.pos, "-", self.parse_unary())
            self.depth -= 1
            return node
        return self.parse_primary()

    def parse_primary(self) -> Node:
        tok = self.tok
        if tok.kind in (NUM, DUR):
            self.i += 1
            return Num(tok.pos, tok.value, tok.raw, tok.kind == DUR)
        if tok.kind == NAME and self.toks[self.i + 1].kind == OP and self.toks[self.i + 1].text == "(":
            return self.parse_call()
        if tok.kind in (NAME, QNAME):
            self.i += 1
            if tok.text.startswith("_"):
                self.error(tok.pos, "names starting with '_' are reserved (use step() for the step)")
            metric = Metric(tok.pos, tok.text, quoted=tok.kind == QNAME)
            if self.tok.kind == OP and self.tok.text == "[":
                self.parse_window(metric)
            return metric
        if tok.kind == OP and tok.text == "(":
            self.i += 1
            self.nest(tok.pos)
            node = self.parse_or()
            self.depth -= 1
            if not self.take(")"):
                if self.tok.kind == END:
                    self.error(tok.pos, "unclosed '('")
                self.unexpected()
            return node
        self.unexpected()
        raise AssertionError  # unexpected() always raises

    def parse_window(self, metric: Metric) -> None:
        open_pos = self.tok.pos
        self.i += 1
        tok = self.tok
        if tok.kind == NUM:
            if tok.value != int(tok.value) or not tok.raw.isdigit():
                self.error(tok.pos, "a window is a whole number of points or a duration like 30s")
            if not 1 <= tok.value <= MAX_WINDOW_POINTS:
                self.error(tok.pos, f"a window holds 1 to {MAX_WINDOW_POINTS} points")
            metric.points = int(tok.value)
        elif tok.kind == DUR:
            if tok.value <= 0:
                self.error(tok.pos, "a time window must be longer than 0s")
            metric.seconds = tok.value
        else:
            self.error(tok.pos, "expected a window size like [50] or [30s]")
        metric.window_text = tok.raw
        self.i += 1
        if not self.take("]"):
            self.error(self.tok.pos if self.tok.kind != END else open_pos, "expected ']'")

    def parse_call(self) -> Node:
        tok = self.tok
        self.i += 2
        self.nest(tok.pos)
        call = Call(tok.pos, tok.text)
        if not self.take(")"):
            while True:
                call.args.append(self.parse_or())
                if self.take(")"):
                    break
                if not self.take(","):
                    if self.tok.kind == END:
                        self.error(tok.pos, f"unclosed '(' of {tok.text}()")
                    self.unexpected()
        self.depth -= 1
        return call


class _Checker:
    """Validates function names, arity, window placement and types after parsing."""

    def __init__(self, text: str, label: str | None) -> None:
        self.text = text
        self.label = label

    def error(self, node: Node, message: str) -> None:
        fail(self.text, node.pos, message, self.label)

    def check(self, node: Node, window_ok: bool = False) -> None:
        if isinstance(node, Metric):
            if node.windowed and not window_ok:
                self.error(node, f"a window like {render(node)} is only allowed inside an "
                                 f"aggregate, e.g. mean({render(node)})")
        elif isinstance(node, Call):
            self.check_call(node)
        elif isinstance(node, Unary):
            self.check(node.operand)
        elif isinstance(node, Binary):
            self.check(node.left)
            self.check(node.right)

    def check_call(self, node: Call) -> None:
        name, args = node.name, node.args
        if name not in FUNCTIONS:
            close = difflib.get_close_matches(name, sorted(FUNCTIONS), n=1)
            hint = f" (did you mean {close[0]}()?)" if close else ""
            self.error(node, f"unknown function {name}(){hint}")
        if name in ("min", "max") and len(args) == 2:
            for arg in args:
                self.check(arg)
            return
        if name in AGGREGATES or name in WINDOW_FUNCS:
            self.arity(node, 1, " or two numbers" if name in ("min", "max") else "")
            arg = args[0]
            if not (isinstance(arg, Metric) and arg.windowed):
                two = f", or two numbers, e.g. {name}(a, b)" if name in ("min", "max") else ""
                self.error(arg, f"{name}() needs a window, e.g. {name}(loss[50]) or "
                                f"{name}(loss[5m]){two}")
            assert isinstance(arg, Metric)
            if name in POINT_WINDOW_ONLY and arg.points is None:
                self.error(arg, f"{name}() needs a window of points, e.g. {name}(loss[20])")
            if name in WINDOW_FUNCS and arg.points is not None and arg.points < 2:
                self.error(arg, f"{name}() needs a window of at least 2 points")
            return
        if name in NULLARY_FUNCS:
            self.arity(node, 0)
            return
        self.arity(node, 1)
        arg = args[0]
        if name in METRIC_FUNCS:
            if not isinstance(arg, Metric):
                self.error(arg, f"{name}() takes a metric name, e.g. {name}(loss)")
            assert isinstance(arg, Metric)
            if arg.windowed:
                self.error(arg, f"{name}() does not take a window; write {name}({render_name(arg)})")
        elif name in DURATION_FUNCS:
            if not isinstance(arg, Num):
                self.error(arg, f"{name}() takes a duration, e.g. {name}(5m)")
            assert isinstance(arg, Num)
            if arg.value <= 0:
                self.error(arg, f"{name}() needs a duration longer than 0s")
        else:
            self.check(arg)

    def arity(self, node: Call, want: int, extra: str = "") -> None:
        got = len(node.args)
        if got != want:
            noun = "no arguments" if want == 0 else f"{want} argument{'s' if want > 1 else ''}"
            self.error(node, f"{node.name}() takes {noun}{extra}, got {got}")


def parse_condition(text: str, start: int = 0, end: int | None = None,
                    label: str | None = None) -> Node:
    """Parse and check `text[start:end]` as a condition; errors point into the whole `text`."""
    node = _Parser(text, start, len(text) if end is None else end, label).parse()
    deep = _too_deep(node)
    if deep is not None:
        fail(text, deep.pos, f"expression nested more than {MAX_TREE_DEPTH} levels deep", label)
    _Checker(text, label).check(node)
    if not is_bool(node):
        what = render(node)
        fail(text, node.pos, f"the condition {what!r} is a number, not true/false; "
                             f"compare it, e.g. {what} > 0", label)
    return node


def _children(node: Node) -> list[Node]:
    if isinstance(node, Call):
        return node.args
    if isinstance(node, Unary):
        return [node.operand]
    if isinstance(node, Binary):
        return [node.left, node.right]
    return []


def _too_deep(root: Node) -> Node | None:
    """The first node deeper than MAX_TREE_DEPTH, found without recursion."""
    stack = [(root, 1)]
    while stack:
        node, depth = stack.pop()
        if depth > MAX_TREE_DEPTH:
            return node
        stack.extend((child, depth + 1) for child in _children(node))
    return None


def walk(node: Node) -> list[Node]:
    """All nodes of the tree, parents before children, left to right."""
    out: list[Node] = []
    stack = [node]
    while stack:
        cur = stack.pop()
        out.append(cur)
        stack.extend(reversed(_children(cur)))
    return out


def render_name(node: Metric) -> str:
    """A metric name as it would be written in a rule (quoted when it needs to be)."""
    name = node.name
    try:
        toks = tokenize(name)
    except ValueError:
        toks = []
    if len(toks) == 2 and toks[0].kind == NAME and toks[0].text == name:
        return name
    quote = next((q for q in "`\"'" if q not in name), "`")
    return f"{quote}{name}{quote}"


def render(node: Node, parens: bool = False, values: dict[int, str] | None = None) -> str:
    """Print `node`: fully parenthesised, or with the fewest parentheses.

    `values` maps id(node) to a suffix such as "=101.5" (used to show observed values).
    """
    suffix = values.get(id(node), "") if values else ""
    if isinstance(node, Num):
        return node.text
    if isinstance(node, Metric):
        win = f"[{node.window_text}]" if node.windowed else ""
        return f"{render_name(node)}{win}{suffix}"
    if isinstance(node, Call):
        inner = ", ".join(render(a, parens, values) for a in node.args)
        return f"{node.name}({inner}){suffix}"
    if isinstance(node, Unary):
        sep = " " if node.op == "not" else ""
        inner = render(node.operand, parens, values)
        if parens:
            return f"({node.op}{sep}{inner})"
        mine = _PREC["not"] if node.op == "not" else _UNARY_MINUS_PREC
        if _prec(node.operand) < mine:
            inner = f"({inner})"
        return f"{node.op}{sep}{inner}"
    assert isinstance(node, Binary)
    left = render(node.left, parens, values)
    right = render(node.right, parens, values)
    if parens:
        return f"({left} {node.op} {right})"
    mine = _PREC[node.op]
    if _prec(node.left) < mine or (mine == 4 and _prec(node.left) == 4):
        left = f"({left})"
    if _prec(node.right) <= mine:
        right = f"({right})"
    return f"{left} {node.op} {right}"


def _prec(node: Node) -> int:
    if isinstance(node, Binary):
        return _PREC[node.op]
    if isinstance(node, Unary):
        return _PREC["not"] if node.op == "not" else _UNARY_MINUS_PREC
    return _ATOM_PREC
