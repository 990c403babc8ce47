"""Mask expressions (issue 20, `mask_mod`): which keys each query attends to, written as a short C expression over
`b` (the sequence in the batch), `h` (the query head), `q_idx`, `kv_idx` (positions in the sequence) and up to
four user tensors, for example document masking of packed sequences:

    mask = MaskMod("doc[q_idx] == doc[kv_idx] && q_idx >= kv_idx", doc=document_ids)   # doc: (seqlen,) int

A pair (q_idx, kv_idx) is attended where the expression is nonzero. The expression is parsed here once (a C
subset: integer literals, + - * / % (C's: truncating), << >> & | ^ ~, comparisons, && || !, ?:, parentheses,
min / max / abs, and subscripts of the user tensors, one per dimension), then

  - evaluated with torch on a grid of (b, h, q_idx, kv_idx) for the reference (`MaskMod.evaluate`), and
  - emitted as C (`MaskMod.c_source`) for the kernels' build path, which compiles it into the kernel (cached by
    the expression's text); a tensor subscript becomes a load at the tensor's strides.

The same AST serves both, so the reference and the kernels compute the same mask. Errors name the expression and
the position (`MaskModError`).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch
from torch import Tensor

INDEX_NAMES = ("b", "h", "q_idx", "kv_idx")
MAX_TENSORS = 4
TENSOR_DTYPES = (torch.int32, torch.int64, torch.bool, torch.uint8, torch.int16, torch.int8)
FUNCTIONS = {"min": 2, "max": 2, "abs": 1}
_C_TYPES = {torch.int32: "int", torch.int64: "long long", torch.bool: "bool", torch.uint8: "unsigned char",
            torch.int16: "short", torch.int8: "signed char"}

# binary operators by precedence, loosest first (C's table, without assignment and comma)
_BINARY = (("||",), ("&&",), ("|",), ("^",), ("&",), ("==", "!="), ("<", "<=", ">", ">="), ("<<", ">>"),
           ("+", "-"), ("*", "/", "%"))
_TOKEN = re.compile(r"\s*(?:(?P<int>\d+)|(?P<name>[A-Za-z_]\w*)|(?P<op>\|\||&&|==|!=|<=|>=|<<|>>|[-+*/%<>!~&|^?:()\[\],]))")


class MaskModError(ValueError):
    """An expression that does not parse, names what does not exist, or subscripts a tensor wrongly."""


@dataclass(frozen=True)
class Node:
    kind: str  # int | name | unary | binary | ternary | call | subscript
    value: object = None  # the literal, name, operator or function
    args: tuple = ()


class _Parser:
    def __init__(self, text: str):
        self.text, self.tokens, pos = text, [], 0
        while pos < len(text):
            if text[pos:].strip() == "":
                break
            match = _TOKEN.match(text, pos)
            if match is None:
                at = len(text) - len(text[pos:].lstrip())
                self.fail(f"unexpected character {text[at]!r}", at)
            kind = match.lastgroup
            self.tokens.append((kind, match.group(kind), match.start(kind)))
            pos = match.end()
        self.i = 0

    def fail(self, message: str, pos: int | None = None):
        if pos is None:
            pos = self.tokens[self.i][2] if self.i < len(self.tokens) else len(self.text)
        raise MaskModError(f"mask_mod {self.text!r}: {message} at column {pos + 1}\n  {self.text}\n  {' ' * pos}^")

    def peek(self):
        return self.tokens[self.i] if self.i < len(self.tokens) else (None, None, len(self.text))

    def take(self, op: str | None = None):
        token = self.peek()
        if op is not None and token[1] != op:
            self.fail(f"expected {op!r}" + (f", got {token[1]!r}" if token[1] else ", got the end"))
        if token[0] is None:
            self.fail("unexpected end of the expression")
        self.i += 1
        return token

    def parse(self) -> Node:
        if not self.tokens:
            self.fail("empty expression", 0)
        node = self.ternary()
        if self.i != len(self.tokens):
            self.fail(f"unexpected {self.peek()[1]!r}")
        return node

    def ternary(self) -> Node:
        cond = self.binary(0)
        if self.peek()[1] == "?":
            self.take("?")
            yes = self.ternary()
            self.take(":")
            return Node("ternary", None, (cond, yes, self.ternary()))
        return cond

    def binary(self, level: int) -> Node:
        if level == len(_BINARY):
            return self.unary()
        node = self.binary(level + 1)
        while self.peek()[0] == "op" and self.peek()[1] in _BINARY[level]:
            op = self.take()[1]
            node = Node("binary", op, (node, self.binary(level + 1)))
        return node

    def unary(self) -> Node:
        if self.peek()[0] == "op" and self.peek()[1] in ("!", "-", "+", "~"):
            op = self.take()[1]
            return Node("unary", op, (self.unary(),))
        return self.postfix()

    def postfix(self) -> Node:
        node = self.primary()
        while self.peek()[1] == "[":
            if node.kind not in ("name", "subscript"):
                self.fail("only a user tensor can be subscripted")
            self.take("[")
            index = self.ternary()
            self.take("]")
            base, indices = (node.value, node.args + (index,)) if node.kind == "subscript" else (node.value, (index,))
            node = Node("subscript", base, indices)
        return node

    def primary(self) -> Node:
        kind, value, pos = self.peek()
        if kind == "int":
            self.take()
            return Node("int", int(value))
        if kind == "name":
            self.take()
            if self.peek()[1] == "(":
                if value not in FUNCTIONS:
                    self.fail(f"unknown function {value!r} (there are {', '.join(FUNCTIONS)})", pos)
                self.take("(")
                args = [self.ternary()]
                while self.peek()[1] == ",":
                    self.take(",")
                    args.append(self.ternary())
                self.take(")")
                if len(args) != FUNCTIONS[value]:
                    self.fail(f"{value}() takes {FUNCTIONS[value]} argument(s), got {len(args)}", pos)
                return Node("call", value, tuple(args))
            return Node("name", value)
        if value == "(":
            self.take("(")
            node = self.ternary()
            self.take(")")
            return node
        self.fail(f"unexpected {value!r}" if value else "unexpected end of the expression")


def _names(node: Node, out: dict) -> dict:
    if node.kind == "name":
        out.setdefault(node.value, 0)
    elif node.kind == "subscript":
        out[node.value] = max(out.get(node.value, 0), len(node.args))
    for arg in node.args:
        _names(arg, out)
    return out


class MaskMod:
    """A parsed mask expression with its user tensors (keyword arguments: name -> integer or bool tensor, at most
    MAX_TENSORS, each subscripted once per dimension in the expression)."""

    def __init__(self, expression: str, **tensors: Tensor):
        if not isinstance(expression, str):
            raise TypeError(f"mask_mod must be a string (a C expression), got {type(expression).__name__}")
        self.expression = expression
        self.ast = _Parser(expression).parse()
        if len(tensors) > MAX_TENSORS:
            raise MaskModError(f"mask_mod {expression!r}: at most {MAX_TENSORS} tensors, got {len(tensors)}")
        for name, tensor in tensors.items():
            if name in INDEX_NAMES or name in FUNCTIONS:
                raise MaskModError(f"mask_mod {expression!r}: tensor {name!r}: the name is taken "
                                   f"({', '.join(INDEX_NAMES)}, {', '.join(FUNCTIONS)})")
            if not isinstance(tensor, Tensor):
                raise TypeError(f"mask_mod tensor {name!r} must be a torch.Tensor, got {type(tensor).__name__}")
            if tensor.dtype not in TENSOR_DTYPES:
                raise MaskModError(f"mask_mod {expression!r}: tensor {name!r} must be an integer or bool tensor, got "
                                   f"{tensor.dtype}")
        self.tensors = dict(tensors)
        used = _names(self.ast, {})  # name -> subscripts (0: an index or unsubscripted)
        for name, subscripts in used.items():
            if name in INDEX_NAMES:
                if subscripts:
                    raise MaskModError(f"mask_mod {expression!r}: {name} is an index, it cannot be subscripted")
            elif name not in self.tensors:
                raise MaskModError(f"mask_mod {expression!r}: unknown name {name!r} (indices: "
                                   f"{', '.join(INDEX_NAMES)}; tensors given: {', '.join(self.tensors) or 'none'})")
            elif subscripts != self.tensors[name].dim():
                raise MaskModError(f"mask_mod {expression!r}: tensor {name!r} has {self.tensors[name].dim()} "
                                   f"dimension(s) and needs as many subscripts, got {subscripts}")
        for name in self.tensors:
            if name not in used:
                raise MaskModError(f"mask_mod {expression!r}: tensor {name!r} is given but not used")

    def __repr__(self) -> str:
        return f"MaskMod({self.expression!r}, tensors={list(self.tensors)})"

    # ---- the reference: torch on a grid --------------------------------------------------------------------------
    def evaluate(self, b: Tensor | int, h: Tensor | int, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        """The mask (bool) on the broadcast of the index tensors (int64), e.g. b (B,1,1,1), h (1,H,1,1),
        q_idx (1,1,Sq,1), kv_idx (1,1,1,Sk) -> (B, H, Sq, Sk)."""
        device = q_idx.device
        env = {name: torch.as_tensor(value, device=device, dtype=torch.int64)
               for name, value in zip(INDEX_NAMES, (b, h, q_idx, kv_idx))}
        shape = torch.broadcast_shapes(*(t.shape for t in env.values()))
        return (self._eval(self.ast, env) != 0).expand(shape)

    def _eval(self, node: Node, env: dict) -> Tensor:
        kind = node.kind
        if kind == "int":
            return torch.tensor(node.value, dtype=torch.int64, device=next(iter(env.values())).device)
        if kind == "name":
            return env[node.value]
        if kind == "subscript":
            tensor = self.tensors[node.value]
            indices = torch.broadcast_tensors(*(_int(self._eval(arg, env)).to(tensor.device) for arg in node.args))
            for dim, index in enumerate(indices):
                if index.numel() and (int(index.min()) < 0 or int(index.max()) >= tensor.shape[dim]):
                    raise MaskModError(f"mask_mod {self.expression!r}: subscript {dim} of {node.value!r} reaches "
                                       f"{int(index.min())}..{int(index.max())}, outside 0..{tensor.shape[dim] - 1}")
            return _int(tensor[tuple(indices)])
        if kind == "call":
            args = [_int(self._eval(arg, env)) for arg in node.args]
            return {"min": torch.minimum, "max": torch.maximum}[node.value](*args) if node.value != "abs" \
                else args[0].abs()
        if kind == "ternary":
            cond, yes, no = (self._eval(arg, env) for arg in node.args)
            return torch.where(cond != 0, _int(yes), _int(no))
        if kind == "unary":
            x = self._eval(node.args[0], env)
            return {"!": lambda: (x == 0).long(), "-": lambda: -_int(x), "+": lambda: _int(x),
                    "~": lambda: ~_int(x)}[node.value]()
        a, b = (self._eval(arg, env) for arg in node.args)
        op = node.value
        if op in ("&&", "||"):
            return ((a != 0) & (b != 0) if op == "&&" else (a != 0) | (b != 0)).long()
        a, b = _int(a), _int(b)
        if op == "/":
            return torch.div(a, b, rounding_mode="trunc")
        if op == "%":
            return torch.fmod(a, b)  # C: the remainder takes the dividend's sign
        result = {"+": torch.add, "-": torch.sub, "*": torch.mul, "<<": torch.bitwise_left_shift,
                  ">>": torch.bitwise_right_shift, "&": torch.bitwise_and, "|": torch.bitwise_or,
                  "^": torch.bitwise_xor, "==": torch.eq, "!=": torch.ne, "<": torch.lt, "<=": torch.le,
                  ">": torch.gt, ">=": torch.ge}[op](a, b)
        return _int(result)

    # ---- the kernels: C source --------------------------------------------------------------------------------
    def c_source(self) -> str:
        """A C expression (64-bit integer arithmetic) over b, h, q_idx, kv_idx and, per user tensor NAME, a pointer
        `mm_NAME` and its strides `mm_NAME_s0`, `mm_NAME_s1`, ... in elements: what the kernels' mask function
        returns (nonzero: attended)."""
        return self._c(self.ast)

    def c_declarations(self) -> list[str]:
        """The parameters the expression reads besides the indices, as C declarations (pointer, then strides)."""
        out = []
        for name, tensor in self.tensors.items():
            out.append(f"const {_C_TYPES[tensor.dtype]}* mm_{name}")
            out += [f"long long mm_{name}_s{dim}" for dim in range(tensor.dim())]
        return out

    def _c(self, node: Node) -> str:
        kind = node.kind
        if kind == "int":
            return f"{node.value}LL"
        if kind == "name":
            return f"((long long)({node.value}))"
        if kind == "subscript":
            offset = " + ".join(f"({self._c(arg)}) * mm_{node.value}_s{dim}" for dim, arg in enumerate(node.args))
            return f"((long long)mm_{node.value}[{offset}])"
        if kind == "call":
            args = [self._c(arg) for arg in node.args]
            if node.value == "abs":
                return f"(({args[0]}) < 0 ? -({args[0]}) : ({args[0]}))"
            cmp = "<" if node.value == "min" else ">"
            return f"(({args[0]}) {cmp} ({args[1]}) ? ({args[0]}) : ({args[1]}))"
        if kind == "ternary":
            cond, yes, no = (self._c(arg) for arg in node.args)
            return f"(({cond}) ? ({yes}) : ({no}))"
        if kind == "unary":
            return f"({node.value}({self._c(node.args[0])}))"
        a, b = (self._c(arg) for arg in node.args)
        return f"((long long)(({a}) {node.value} ({b})))"


def _int(x: Tensor) -> Tensor:
    return x.long() if x.dtype != torch.int64 else x
