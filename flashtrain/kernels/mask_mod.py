"""Mask expressions (`mask_mod`): which keys each query attends to, written as a short C expression over
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

from flashtrain.kernels import build

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
            if int(value) > _INT64_MAX:
                self.fail(f"integer literal {value} does not fit the 64-bit arithmetic of the kernels", pos)
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
    def c_source(self, checked: bool = False) -> str:
        """A C expression (64-bit integer arithmetic) over b, h, q_idx, kv_idx and, per user tensor NAME, a pointer
        `mm_NAME` and its strides `mm_NAME_s0`, `mm_NAME_s1`, ... in elements: what the kernels' mask function
        returns (nonzero: attended). checked: each subscript is tested against the sizes `mm_NAME_n0`, ... and an
        out-of-range one evaluates `FT_MM_OOB()` (the kernels: records the error, the element reads as 0) instead of
        loading."""
        return self._c(self.ast, checked)

    @property
    def index_names(self) -> tuple[str, ...]:
        """The indices (of b, h, q_idx, kv_idx) the expression reads."""
        used = _names(self.ast, {})
        return tuple(name for name in INDEX_NAMES if name in used)

    def kernel_defines(self) -> tuple[tuple[str, str], ...]:
        """The macros csrc/mask_mod.cuh builds its predicate from: FT_MASK_DECLS (tensor i's pointer, sizes and strides
        read from MaskModParams `mm`, in the order given) and FT_MASK_EXPR (the checked C source). The build cache
        keys kernels by their macros, so by the expression and the tensors' dtypes and ranks."""
        decls = []
        for i, (name, tensor) in enumerate(self.tensors.items()):
            ctype = _C_TYPES[tensor.dtype]
            decls.append(f"const {ctype}* mm_{name} = (const {ctype}*)mm.ptr[{i}];")
            for d in range(tensor.dim()):
                decls += [f"const long long mm_{name}_s{d} = mm.stride[{i}][{d}];",
                          f"const long long mm_{name}_n{d} = mm.size[{i}][{d}];"]
        defines = (("FT_MASK_DECLS", " ".join(decls)), ("FT_MASK_EXPR", self.c_source(checked=True)))
        # (nvcc splits a -D value at commas: the emitted C has none, min / max / abs being conditionals)
        assert not any("," in value for _, value in defines), defines
        return defines

    def subscripts_in_range(self, batch: int, nheads: int, seqlen_q: int, seqlen_k: int) -> bool:
        """Whether interval arithmetic over b < batch, h < nheads, q_idx < seqlen_q, kv_idx < seqlen_k proves every
        subscript inside its tensor and every divisor nonzero (then no kernel can set the error word, and a call
        needs no check of it). False means unproven, not wrong: a subscript of a tensor's value, say."""
        ranges = {"b": (0, batch - 1), "h": (0, nheads - 1), "q_idx": (0, seqlen_q - 1), "kv_idx": (0, seqlen_k - 1)}
        proven = [True]
        self._bounds(self.ast, ranges, proven)
        return proven[0]

    def _bounds(self, node: Node, ranges: dict, proven: list) -> tuple[int, int] | None:
        """(lowest, highest) value of the node over the index ranges, None when unbounded or when the kernels'
        64-bit arithmetic could wrap there; proven[0] turns False at a subscript or divisor it cannot bound."""
        bounds = self._node_bounds(node, ranges, proven)
        if bounds is not None and (bounds[0] < _INT64_MIN or bounds[1] > _INT64_MAX):
            return None
        return bounds

    def _node_bounds(self, node: Node, ranges: dict, proven: list) -> tuple[int, int] | None:
        kind, op = node.kind, node.value
        args = [self._bounds(arg, ranges, proven) for arg in node.args]
        if kind == "int":
            return op, op
        if kind == "name" and op in ranges:
            return ranges[op]
        if kind in ("name", "subscript"):  # a tensor's element (a 0-dimensional tensor: its name)
            tensor = self.tensors[op]
            for dim, bound in enumerate(args):
                if bound is None or bound[0] < 0 or bound[1] >= tensor.shape[dim]:
                    proven[0] = False
            if tensor.dtype == torch.bool:
                return 0, 1
            info = torch.iinfo(tensor.dtype)
            return info.min, info.max
        if kind in ("ternary",):
            yes, no = args[1], args[2]
            return None if yes is None or no is None else (min(yes[0], no[0]), max(yes[1], no[1]))
        if (kind == "unary" and op == "!") or (kind == "binary" and op in ("&&", "||", "==", "!=", "<", "<=", ">",
                                                                              ">=")):
            return 0, 1
        if any(a is None for a in args):
            if kind == "binary" and op in ("/", "%"):
                proven[0] = False
            return None
        if kind == "unary":
            (lo, hi), = args
            return {"-": (-hi, -lo), "+": (lo, hi), "~": (-hi - 1, -lo - 1)}[op]
        if kind == "call":
            if op == "abs":  # (abs of INT64_MIN wraps in C: its bound 2^63 is past the range, so None above)
                (lo, hi), = args
                return (0 if lo <= 0 <= hi else min(abs(lo), abs(hi))), max(abs(lo), abs(hi))
            (alo, ahi), (blo, bhi) = args
            return (min(alo, blo), min(ahi, bhi)) if op == "min" else (max(alo, blo), max(ahi, bhi))
        (alo, ahi), (blo, bhi) = args
        if op in ("+", "-", "*"):
            f = {"+": lambda x, y: x + y, "-": lambda x, y: x - y, "*": lambda x, y: x * y}[op]
            values = [f(x, y) for x in (alo, ahi) for y in (blo, bhi)]
            return min(values), max(values)
        if op in ("/", "%"):
            if blo <= 0 <= bhi:
                proven[0] = False  # a divisor that may be zero
                return None
            if op == "%":  # C: |a % b| < |b|, the dividend's sign
                m = max(abs(blo), abs(bhi)) - 1
                return (0 if alo >= 0 else -min(m, -alo)), (0 if ahi <= 0 else min(m, ahi))
            values = [(abs(x) // abs(y)) * (1 if (x >= 0) == (y > 0) else -1)  # C: truncation toward zero
                      for x in (alo, ahi) for y in (blo, bhi)]
            return min(values), max(values)
        if op in ("<<", ">>"):
            if blo < 0 or bhi > 62:
                return None
            if op == ">>":
                return alo >> (bhi if alo >= 0 else blo), ahi >> (blo if ahi >= 0 else bhi)
            return (alo << (bhi if alo < 0 else blo)), (ahi << (bhi if ahi >= 0 else blo))
        if alo >= 0 and blo >= 0:  # & | ^ of non-negative values
            if op == "&":
                return 0, min(ahi, bhi)
            return 0, (1 << max(ahi, bhi).bit_length()) - 1
        return None

    def block_states(self, batch: int, nheads: int, seqlen_q: int, seqlen_k: int, *, device,
                     block: int = 128, cu_seqlens_q: Tensor | None = None,
                     cu_seqlens_k: Tensor | None = None, window: tuple[int, int] = (-1, -1)) -> tuple[Tensor, Tensor]:
        """Per block x block tile of (query, key) pairs: 0 when the expression is false for every pair of the tile,
        2 when true for every pair, 1 otherwise (tiles counted from each sequence's start; pairs past a sequence's
        end do not count). window (keys before, after the diagonal; causal: after = 0; -1: unbounded): tiles it hides
        entirely are 0 unevaluated. Evaluated exactly, on `device`: with the compiled expression on a GPU
        (csrc/mask_blocks.cu), with `evaluate` elsewhere. Returns (states uint8 (B', H', n_qblocks, n_kblocks),
        error int32 (1,)): B' = batch when the expression reads b or the sequences are varlen, else 1; H' = nheads
        when it reads h, else 1; error nonzero when a subscript left its tensor (the GPU path records it without a
        host sync; `evaluate` raises). Varlen: cu_seqlens_q / cu_seqlens_k (batch + 1,) int32, seqlen_q / seqlen_k
        the maximum lengths."""
        device = torch.device(device)
        varlen = cu_seqlens_q is not None
        if varlen != (cu_seqlens_k is not None):
            raise ValueError("block_states: give both cu_seqlens_q and cu_seqlens_k, or neither")
        if block <= 0 or block & (block - 1) or block > 256:
            raise ValueError(f"block_states: block must be a power of two <= 256, got {block}")
        heads = nheads if "h" in self.index_names else 1
        batches = batch if "b" in self.index_names or varlen else 1
        n_q, n_k = -(-seqlen_q // block), -(-seqlen_k // block)
        left, right = (int(w) for w in window)
        if device.type == "cuda":
            from flashtrain.kernels import mask_blocks

            return mask_blocks.block_states(self, batches, heads, seqlen_q, seqlen_k, block, cu_seqlens_q,
                                            cu_seqlens_k, (left, right), device)
        states = torch.zeros(batches, heads, n_q, n_k, dtype=torch.uint8, device=device)
        arange = lambda n: torch.arange(n, device=device)  # noqa: E731
        for b in range(batches):
            len_q, len_k = seqlen_q, seqlen_k
            if varlen:
                len_q = int(cu_seqlens_q[b + 1] - cu_seqlens_q[b])
                len_k = int(cu_seqlens_k[b + 1] - cu_seqlens_k[b])
            if len_q == 0 or len_k == 0:
                continue
            for qb in range(-(-len_q // block)):
                rows = arange(min(block, len_q - qb * block)) + qb * block
                visible = self.evaluate(b, arange(heads)[:, None, None], rows[None, :, None],
                                        arange(len_k)[None, None, :])
                pad = n_k * block - len_k  # keys past the end: neither visible nor blocking "all"
                anyv = torch.nn.functional.pad(visible, (0, pad), value=False).view(heads, -1, n_k, block)
                allv = torch.nn.functional.pad(visible, (0, pad), value=True).view(heads, -1, n_k, block)
                tile_any, tile_all = anyv.any(3).any(1), allv.all(3).all(1)
                tiles = -(-len_k // block)
                state = torch.where(tile_all, 2, torch.where(tile_any, 1, 0)).to(torch.uint8)
                # tiles the window hides entirely (key - query distances from the bottom-right diagonal)
                k0 = arange(tiles) * block
                lowest = k0 - int(rows[-1]) - (len_k - len_q)
                highest = torch.clamp(k0 + block, max=len_k) - 1 - qb * block - (len_k - len_q)
                hidden = ((right >= 0) & (lowest > right)) | ((left >= 0) & (highest < -left))
                states[b, :, qb, :tiles] = torch.where(hidden, 0, state[:, :tiles]).to(torch.uint8)
        return states, torch.zeros(1, dtype=torch.int32, device=device)

    def call_states(self, batch: int, nheads: int, seqlen_q: int, seqlen_k: int, *, device, block: int = 128,
                    cu_seqlens_q: Tensor | None = None, cu_seqlens_k: Tensor | None = None,
                    window: tuple[int, int] = (-1, -1)) -> tuple[Tensor, Tensor]:
        """block_states for an attention call, packed for the kernels (pack_states), cached: the layers of a model
        and the steps that reuse this MaskMod with the same tensor objects, unmodified (torch's version counters:
        in-place writes through torch bump them; writes through `.data`, DLPack or other kernels are not seen), and
        the same shapes / cu_seqlens tensors share one evaluation. Not cached while a CUDA graph is captured (the
        states kernel is captured with the call, so replays see new tensor contents). A subscript or divisor that
        interval arithmetic cannot prove safe (subscripts_in_range) is checked once per evaluation by reading the
        error word (one host sync; refused inside a CUDA graph capture), so it raises MaskModError here instead of
        reading 0 in the kernels."""
        import weakref

        tensors = tuple(self.tensors.values())
        capturing = torch.device(device).type == "cuda" and torch.cuda.is_current_stream_capturing()
        try:
            versions = tuple((t._version, t.data_ptr(), tuple(t.shape), t.stride()) for t in tensors)
            cu_versions = tuple(t._version for t in (cu_seqlens_q, cu_seqlens_k) if t is not None)
        except RuntimeError:  # inference-mode tensors have no version counter: no cache
            versions = cu_versions = None
        cached = versions is not None and not capturing
        key = (batch, nheads, seqlen_q, seqlen_k, str(device), block, tuple(window), versions, cu_versions)
        cache = self.__dict__.setdefault("_states_cache", {})
        hit = cache.get(key) if cached else None
        if hit is not None and all(ref() is t for ref, t in zip(hit[0], (cu_seqlens_q, cu_seqlens_k, *tensors))):
            return hit[1]
        proven = self.subscripts_in_range(batch, nheads, seqlen_q, seqlen_k)
        if capturing and not proven:
            raise MaskModError(f"mask_mod {self.expression!r}: a subscript or divisor that cannot be proven in range "
                               "needs a host read of the error word, which a CUDA graph capture cannot do; bound it "
                               "with min / max")
        states, error = self.block_states(batch, nheads, seqlen_q, seqlen_k, device=device, block=block,
                                          cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k, window=window)
        states = pack_states(states)
        if not proven and int(error) != 0:
            raise MaskModError(f"mask_mod {self.expression!r}: a subscript left its tensor or a divisor was 0 "
                               "(tensors " + ", ".join(f"{n} {tuple(t.shape)}" for n, t in self.tensors.items())
                               + f"; batch {batch}, heads {nheads}, seqlen_q {seqlen_q}, seqlen_k {seqlen_k})")
        if cached:
            refs = tuple(weakref.ref(t) if t is not None else (lambda: None)
                         for t in (cu_seqlens_q, cu_seqlens_k, *tensors))
            if len(cache) >= 4:
                cache.pop(next(iter(cache)))
            cache[key] = (refs, (states, error))
        return states, error

    def c_declarations(self) -> list[str]:
        """The parameters the expression reads besides the indices, as C declarations (pointer, then strides)."""
        out = []
        for name, tensor in self.tensors.items():
            out.append(f"const {_C_TYPES[tensor.dtype]}* mm_{name}")
            out += [f"long long mm_{name}_s{dim}" for dim in range(tensor.dim())]
        return out

    def _c(self, node: Node, checked: bool = False) -> str:
        kind = node.kind
        if kind == "int":
            return f"{node.value}LL"
        if kind == "name":
            return f"((long long)({node.value}))"
        if kind == "subscript":
            indices = [self._c(arg, checked) for arg in node.args]
            offset = " + ".join(f"({index}) * mm_{node.value}_s{dim}" for dim, index in enumerate(indices))
            load = f"((long long)mm_{node.value}[{offset}])"
            if not checked:
                return load
            inside = " && ".join(f"({index}) >= 0 && ({index}) < mm_{node.value}_n{dim}"
                                 for dim, index in enumerate(indices))
            return f"(({inside}) ? {load} : FT_MM_OOB())"
        if kind == "call":
            args = [self._c(arg, checked) for arg in node.args]
            if node.value == "abs":
                return f"(({args[0]}) < 0 ? -({args[0]}) : ({args[0]}))"
            cmp = "<" if node.value == "min" else ">"
            return f"(({args[0]}) {cmp} ({args[1]}) ? ({args[0]}) : ({args[1]}))"
        if kind == "ternary":
            cond, yes, no = (self._c(arg, checked) for arg in node.args)
            return f"(({cond}) ? ({yes}) : ({no}))"
        if kind == "unary":
            return f"({node.value}({self._c(node.args[0], checked)}))"
        a, b = (self._c(arg, checked) for arg in node.args)
        if checked and node.value in ("/", "%"):  # a zero divisor: the error word, and 0, instead of a trap / garbage
            return f"(({b}) == 0 ? FT_MM_OOB() : (long long)(({a}) {node.value} ({b})))"
        return f"((long long)(({a}) {node.value} ({b})))"


_INT64_MIN, _INT64_MAX = -(1 << 63), (1 << 63) - 1


def state_row_bytes(n_kblocks: int) -> int:
    """The row stride of packed block states: the key blocks rounded up to 4 (the ranges after the rows are int32)."""
    return -(-n_kblocks // 4) * 4


def pack_states(states: Tensor) -> Tensor:
    """The kernels' layout of block states (flash.h FwdParams::mm_states) from MaskMod.block_states' (B', H', n_q,
    n_k) uint8: per (b, h), the n_q rows padded to state_row_bytes(n_k) bytes, then per query block the int32 pair
    (first, last) of its non-empty key blocks, then per key block the int32 pair (first, last) of the query blocks
    non-empty in some head of the sequence (empty: first > last). The walks start and end at these ranges instead of
    stepping over every empty tile (a document mask's query block sees one document of keys)."""
    batches, heads, n_q, n_k = states.shape
    pad = torch.nn.functional.pad
    rows = pad(states, (0, state_row_bytes(n_k) - n_k)).reshape(batches, heads, -1)

    def first_last(visible: Tensor, n: int) -> Tensor:  # over the last dim; (n, -1) when none (one sentinel column)
        index = torch.arange(n, device=states.device)
        return torch.stack([pad(torch.where(visible, index, n), (0, 1), value=n).amin(-1),
                            pad(torch.where(visible, index, -1), (0, 1), value=-1).amax(-1)], -1)

    visible = states != 0
    row_ranges = first_last(visible, n_k)  # (B', H', n_q, 2)
    col_ranges = first_last(visible.any(1, keepdim=True).transpose(-1, -2), n_q)  # (B', 1, n_k, 2): any head
    col_ranges = col_ranges.expand(batches, heads, n_k, 2)
    as_bytes = lambda x: x.to(torch.int32).contiguous().view(torch.uint8).reshape(batches, heads, -1)  # noqa: E731
    return torch.cat([rows, as_bytes(row_ranges), as_bytes(col_ranges)], -1).contiguous()


def mask_mod_text(mask: MaskMod) -> str:
    """The flash_attn ops' `mask_mod` argument for a MaskMod: its tensors' names and its expression
    ("name,...;expression")."""
    return ",".join(mask.tensors) + ";" + mask.expression


def mask_mod_from_text(text: str, tensors) -> MaskMod | None:
    """The MaskMod of an op's mask_mod argument and its tensors (mm0..mm3, in the names' order); None for ""."""
    if not text:
        return None
    names, expression = text.split(";", 1)
    names = names.split(",") if names else []
    return MaskMod(expression, **dict(zip(names, tensors)))


# The states of an attention call as one op (the kernels' packed layout, pack_states): what
# ops.flash_attn_cuda calls under torch.compile, where MaskMod.call_states' cache (Python state keyed on version
# counters) cannot be traced. The expression travels as the flash_attn ops' `mask_mod` text ("names;expression").
@torch.library.custom_op("flashtrain::mask_states", mutates_args=(), device_types="cuda")
def mask_states(q: Tensor, mask_mod: str, batch: int, seqlen_q: int, seqlen_k: int, window_left: int,
                window_right: int, cu_seqlens_q: Tensor | None, cu_seqlens_k: Tensor | None, mm0: Tensor | None,
                mm1: Tensor | None, mm2: Tensor | None, mm3: Tensor | None) -> tuple[Tensor, Tensor]:
    mask = mask_mod_from_text(mask_mod, [x for x in (mm0, mm1, mm2, mm3) if x is not None])
    return mask.call_states(batch, q.shape[-2], seqlen_q, seqlen_k, device=q.device, block=build.BLOCK_SPARSE_SIZE,
                            cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k,
                            window=(window_left, window_right))


@mask_states.register_fake
def _(q, mask_mod, batch, seqlen_q, seqlen_k, window_left, window_right, cu_seqlens_q, cu_seqlens_k, mm0, mm1, mm2,
      mm3):
    mask = mask_mod_from_text(mask_mod, [x for x in (mm0, mm1, mm2, mm3) if x is not None])
    n_q, n_k = -(-seqlen_q // build.BLOCK_SPARSE_SIZE), -(-seqlen_k // build.BLOCK_SPARSE_SIZE)
    batches = batch if "b" in mask.index_names or cu_seqlens_q is not None else 1
    heads = q.shape[-2] if "h" in mask.index_names else 1
    size = n_q * state_row_bytes(n_k) + 8 * n_q + 8 * n_k
    return (q.new_empty((batches, heads, size), dtype=torch.uint8), q.new_empty((1,), dtype=torch.int32))


def _int(x: Tensor) -> Tensor:
    return x.long() if x.dtype != torch.int64 else x
