"""Per-tensor type recipes for the synthetic writers: files that look like the mixed low-bit
quantizations people download (unsloth's "UD" files: i-quant experts, a few layers kept at
higher precision, attention at Q8_0 / Q6_K).

Syntax (``--tensor-types``, or the presets' ``tensor_types`` field): comma-separated rules
``ROLE[@LAYERS]=TYPE``, applied in order (a later rule overrides an earlier one)::

    gate=IQ1_S,up=IQ1_S,down=IQ2_XXS,experts@0-1=Q4_K,attn=Q8_0

- ROLE: ``gate``, ``up``, ``down`` (the routed experts' ffn_{gate,up,down}_exps), ``experts``
  (all three), ``shexp`` (shared experts, ffn_*_shexp), ``ffn`` (dense FFN ffn_gate/up/down),
  ``attn`` (every attention matrix: attn_q, attn_k, attn_v, attn_output and the MLA
  projections), ``embd`` (token_embd), ``output`` (the output head);
- LAYERS: ``N`` or ``N-M`` (inclusive), block indices; without it every layer;
- TYPE: any quantized format of the registry (moe_service/formats.py).

Only tensors of random weights take a rule (norms, routers, biases and the successor heads
keep their types). A rule that matches no tensor, a type the registry does not have, or a
type whose block does not divide a matched tensor's row is a ConfigError naming the rule or
the tensor.

Named recipes (:data:`NAMED_RECIPES`, e.g. ``ud-iq1_s``) stand for their rules anywhere in the
list, so ``ud-iq1_s,experts@1=Q4_K`` is the named recipe with one layer's experts at Q4_K.
A named recipe's rules serve every architecture: a rule of one matches only where it applies
(a role the file lacks, e.g. ``shexp`` on qwen3moe, is no error; a tensor whose row its type
does not fit, e.g. DeepSeek's ``attn_k_b`` with rows of 128 under a 256-block type, keeps the
writer's type, as llama.cpp's quantizer falls back for such rows).
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass
from typing import Any

from moe_service.errors import ConfigError
from moe_service.formats import BY_NAME

ROLES: dict[str, str] = {
    "gate": r"ffn_gate_exps\.weight",
    "up": r"ffn_up_exps\.weight",
    "down": r"ffn_down_exps\.weight",
    "experts": r"ffn_(gate|up|down)_exps\.weight",
    "shexp": r"ffn_(gate|up|down)_shexp\.weight",
    "ffn": r"ffn_(gate|up|down)\.weight",
    "attn": r"attn_[a-z0-9_]+\.weight",
    "embd": r"token_embd\.weight",
    "output": r"output\.weight",
}
"""Role -> regular expression of the tensor name after ``blk.N.`` (or the whole name)."""

NAMED_RECIPES: dict[str, str] = {
    # unsloth's dynamic 1.58-bit files (DeepSeek R1 UD-IQ1_S, Kimi K2 UD-IQ1_S): routed gate/up
    # at IQ1_S, down at IQ2_XXS (the most sensitive expert matrix), attention, the shared
    # experts and the dense lead layers kept at 6-8 bits
    "ud-iq1_s": "gate=IQ1_S,up=IQ1_S,down=IQ2_XXS,attn=Q8_0,shexp=Q6_K,ffn=Q6_K,embd=Q4_K,output=Q6_K",
    # unsloth's UD-IQ2_XXS and antirez's DeepSeek V4 files: routed gate/up at IQ2_XXS, down at
    # Q2_K, attention, shared experts and dense layers at Q6_K
    "ud-iq2_xxs": "gate=IQ2_XXS,up=IQ2_XXS,down=Q2_K,attn=Q6_K,shexp=Q6_K,ffn=Q6_K,embd=Q4_K,output=Q6_K",
}
"""Recipes a user passes by name (``--tensor-types ud-iq1_s``), modelled on the low-bit files
people download; their rules apply where they fit (module docstring)."""

RECIPE_TYPES = tuple(n for n, f in BY_NAME.items() if f.family != "float")
"""The types a rule may name: every quantized format of the registry."""

_RULE_RE = re.compile(r"^(?P<role>[a-z]+)(?:@(?P<lo>\d+)(?:-(?P<hi>\d+))?)?=(?P<type>[A-Za-z0-9_]+)$")
_LAYER_RE = re.compile(r"^blk\.(\d+)\.(.+)$")


@dataclass(frozen=True)
class Rule:
    """One ``ROLE[@LAYERS]=TYPE`` rule; layers None: every layer."""

    text: str
    role: str
    qtype: str
    layers: tuple[int, int] | None = None
    named: str | None = None  # the named recipe the rule comes from: applies where it fits

    def matches(self, name: str) -> bool:
        m = _LAYER_RE.match(name)
        if m is None:
            return self.layers is None and re.fullmatch(ROLES[self.role], name) is not None
        layer, rest = int(m.group(1)), m.group(2)
        if self.layers is not None and not self.layers[0] <= layer <= self.layers[1]:
            return False
        return re.fullmatch(ROLES[self.role], rest) is not None


def parse_tensor_types(text: str) -> tuple[Rule, ...]:
    """The rules of a recipe (empty text: none); a name of :data:`NAMED_RECIPES` stands for its
    rules (marked ``named``). ConfigError names a malformed rule, an unknown role, type or
    recipe name."""
    rules: list[Rule] = []
    for part in (p.strip() for p in text.split(",")):
        if not part:
            continue
        if "=" not in part and part.lower() in NAMED_RECIPES:
            name = part.lower()
            rules += [dataclasses.replace(r, named=name) for r in parse_tensor_types(NAMED_RECIPES[name])]
            continue
        m = _RULE_RE.match(part)
        if m is None:
            raise ConfigError(f"tensor type rule {part!r} is not ROLE[@N[-M]]=TYPE (e.g. down@0-2=Q4_K) "
                              f"nor a named recipe ({', '.join(NAMED_RECIPES)})")
        role, qtype = m.group("role"), m.group("type").upper()
        if role not in ROLES:
            raise ConfigError(f"tensor type rule {part!r}: unknown role {role!r} (roles: {', '.join(ROLES)})")
        if qtype not in RECIPE_TYPES:
            raise ConfigError(f"tensor type rule {part!r}: {qtype} is not a quantized format of the registry "
                              f"({', '.join(RECIPE_TYPES)})")
        layers = None
        if m.group("lo") is not None:
            lo = int(m.group("lo"))
            hi = int(m.group("hi")) if m.group("hi") is not None else lo
            if hi < lo:
                raise ConfigError(f"tensor type rule {part!r}: layer range {lo}-{hi} is empty")
            layers = (lo, hi)
        rules.append(Rule(part, role, qtype, layers))
    return tuple(rules)


def _takes_rules(t: Any) -> bool:
    """Whether plan entry ``t`` is a matrix of random weights (TensorPlan, ArchTensor or
    gpt-oss's _Tensor)."""
    if getattr(t, "fill", None) is not None or getattr(t, "rows_of", None) is not None:
        return False
    return getattr(t, "kind", "rand") in ("rand", "random") and len(t.ne) >= 2 and t.qtype not in ("F32", "I32")


def apply_tensor_types(plans: list[Any], text: str, what: str) -> list[Any]:
    """``plans`` with the recipe ``text`` applied (a new list; entries replaced with
    dataclasses.replace, their ``nbytes`` recomputed when it is a field). ``what`` names the
    preset in errors. ConfigError: a rule that matches no tensor, or a type whose block does
    not divide a matched tensor's row (naming the tensor)."""
    rules = parse_tensor_types(text)
    if not rules:
        return plans
    out = list(plans)
    for rule in rules:
        hit = False
        for i, t in enumerate(out):
            if not (_takes_rules(t) and rule.matches(t.name)):
                continue
            qk = BY_NAME[rule.qtype].block_elems
            if t.ne[0] % qk and rule.named is not None:
                continue  # a named recipe's rule where its type does not fit: the writer's type
            hit = True
            if t.ne[0] % qk:
                raise ConfigError(f"{what}: tensor type rule {rule.text!r}: {t.name} has rows of {t.ne[0]} elements, "
                                  f"not a multiple of the {rule.qtype} block {qk}")
            changes: dict[str, Any] = {"qtype": rule.qtype}
            if "nbytes" in {f.name for f in dataclasses.fields(t)}:
                f = BY_NAME[rule.qtype]
                n = 1
                for v in t.ne:
                    n *= v
                changes["nbytes"] = n // f.block_elems * f.block_bytes
            out[i] = dataclasses.replace(t, **changes)
        if not hit and rule.named is None:
            raise ConfigError(f"{what}: tensor type rule {rule.text!r} matches no tensor of random weights")
    return out


def expand_tensor_types(text: str) -> str:
    """``text`` with named recipes written out as their rules (each marked ``NAME:``), for
    digests that must change when a named recipe's definition does."""
    return ",".join(f"{r.named}:{r.text}" if r.named else r.text for r in parse_tensor_types(text))


def recipe_tag(text: str, limit: int = 48) -> str:
    """A file-name fragment naming the recipe ``text`` (empty text: ""): lower case, ``=`` as
    ``-``, ``@`` as ``at``, rules joined by ``+``; cut at ``limit`` characters with ``+etc`` (the
    digest beside it covers the whole recipe). E.g. ``ud-iq1_s``, ``gate-iq1_s+up-iq1_s+...``."""
    parts = [p.strip().lower().replace("=", "-").replace("@", "at") for p in text.split(",") if p.strip()]
    tag = "+".join(parts)
    return tag if len(tag) <= limit else tag[: limit - 4].rstrip("+-") + "+etc"


def tensor_types_arg(ap: Any) -> None:
    """Add ``--tensor-types RECIPE`` to a writer's argument parser."""
    ap.add_argument("--tensor-types", default=None, metavar="RECIPE",
                    help="per-tensor types, e.g. gate=IQ1_S,up=IQ1_S,down=IQ2_XXS,experts@0=Q4_K,attn=Q8_0 "
                         "(roles: " + ", ".join(ROLES) + "; later rules win), or a named recipe: "
                         + ", ".join(NAMED_RECIPES) + " (e.g. ud-iq1_s,experts@1=Q4_K)")
