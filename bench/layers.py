"""`moe-service bench decode --per-layer PRESET`: what one more layer costs, both engines.

A 2-layer benchmark file's decode is dominated by its output head; a user's model has 43-61
layers. This mode writes two synthetic files of one preset that differ only in their layer
count (:class:`LayerPair`: the same layer pattern repeated, the leading layers of another
kind fixed), runs both engines on both files at each depth (bench/decode.py's depth runs:
prefill of D tokens, then ``--decode`` single tokens at depth D), and reports per layer

    t_layer = (t_big - t_small) / (L_big - L_small)

for a decoded token (ms per layer per token) and for the prefill of D tokens (ms per layer),
each engine's, and their ratio llama.cpp / ours (above 1: our layer is cheaper), beside the
whole-file figures. Rounds (``--depth-repeats R``) alternate the two files (small, big,
small, big, ...; both engines back to back per depth within a file's run) and the per-layer
figures are taken per round, then the median over the rounds: a shared host's bandwidth
drifts, and a difference of two times amplifies the drift.

Families (the preset name says which writer):

- ``deepseek4`` (moe_service.synth_deepseek4): ``compress_ratios`` is ``--pattern``
  (default: the preset's ratios) repeated to the layer count; ``--lead-layers`` hash-routed
  layers in both files (default: the preset's, capped at the small file's count), so the
  added layers are gate-routed as most of the real model's;
- ``deepseek2`` (moe_service.synth_deepseek2): ``--lead-layers`` dense layers in both files
  (``n_dense_lead``; default the preset's, capped below the small count), the added layers MoE;
- ``synth`` (moe_service.synth: qwen3moe, llama, qwen2, qwen3): every layer alike.

``--set FIELD=VALUE`` replaces a preset field in both files (e.g. ``n_expert=32`` to keep a
real-shape V4 layer's file small: a decoded token still reads K experts per layer). The files
are written once into ``--pair-dir`` (default ``cache_dir()/bench-layers``) under a name that
carries the preset, the recipe, the layer count and a digest of every field, and reused
afterwards.

``--tensor-types RECIPE`` (moe_service/synth/recipe.py: rules ``ROLE[@N[-M]]=TYPE`` or a named
recipe such as ``ud-iq1_s``) types both files' tensors per role and layer, as the low-bit
files people download (i-quant experts, attention at Q8_0 / Q6_K). Rules with layer ranges
should name layers below the small file's count: then the added layers are the recipe's
plain layers and the per-layer figure is theirs.

    moe-service bench decode --per-layer deepseek-v4-flash --pattern 4,128 --layers 2,4 \\
        --set n_expert=32 --depths 512,2048,4096 --decode 16 --threads 2 --depth-repeats 2
"""

from __future__ import annotations

import dataclasses
import gc
import hashlib
import statistics
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from moe_service.errors import ConfigError

FAMILIES = ("deepseek4", "deepseek2", "synth")


def family_of(preset: str) -> str:
    """The writer family whose PRESETS holds ``preset``; ConfigError naming the known ones."""
    from moe_service import synth, synth_deepseek2, synth_deepseek4

    for fam, mod in (("deepseek4", synth_deepseek4), ("deepseek2", synth_deepseek2), ("synth", synth)):
        if preset in mod.PRESETS:
            return fam
    known = sorted({*synth_deepseek4.PRESETS, *synth_deepseek2.PRESETS, *synth.PRESETS})
    raise ConfigError(f"--per-layer {preset!r}: not a synthetic preset (known: {', '.join(known)}).")


def family_module(family: str):
    import importlib

    return importlib.import_module(
        {
            "deepseek4": "moe_service.synth_deepseek4",
            "deepseek2": "moe_service.synth_deepseek2",
            "synth": "moe_service.synth",
        }[family]
    )


def parse_sets(items: list[str], preset_cls: type) -> dict[str, Any]:
    """``FIELD=VALUE`` strings -> {field: value typed as the preset dataclass field's default
    or annotation (int, float, bool, str, a tuple of ints as ``4,128``)}. ConfigError naming
    the item for an unknown field or a value that does not parse."""
    fields = {f.name: f for f in dataclasses.fields(preset_cls)}
    out: dict[str, Any] = {}
    for item in items:
        name, sep, text = item.partition("=")
        name = name.strip()
        if not sep or name not in fields:
            raise ConfigError(
                f"--set {item!r}: expected FIELD=VALUE with FIELD one of {', '.join(sorted(fields))}."
            )
        kind = str(fields[name].type)
        try:
            if "tuple" in kind:
                value: Any = tuple(int(x) for x in text.split(",") if x.strip())
            elif kind == "bool":
                if text.lower() not in ("1", "0", "true", "false"):
                    raise ValueError(text)
                value = text.lower() in ("1", "true")
            elif kind == "int":
                value = int(text)
            elif kind == "float":
                value = float(text)
            else:
                value = text
        except ValueError:
            raise ConfigError(f"--set {item!r}: {text!r} is not a valid {kind}.") from None
        out[name] = value
    return out


@dataclass(frozen=True)
class LayerPair:
    """Two synthetic files of one preset that differ only in their layer count.

    Attributes:
        preset: a preset name of synth_deepseek4, synth_deepseek2 or synth.
        small, big: layer counts (trunk layers), small < big.
        lead_layers: leading layers of another kind, the same count in both files (deepseek4:
            hash-routed; deepseek2: dense); None: the preset's, capped at ``small`` (deepseek4)
            or ``small - 1`` (deepseek2). Ignored (must be None) for the ``synth`` family.
        pattern: deepseek4's compress ratios per layer, repeated to the layer count (None:
            the preset's ratios); ``big - small`` must be a whole number of repetitions.
        overrides: preset fields replaced in both files ((field, value) pairs).
        seed: the writers' seed (the same layer index gets the same bytes in both files: the
            tensors are seeded by name).
    """

    preset: str
    small: int
    big: int
    lead_layers: int | None = None
    pattern: tuple[int, ...] | None = None
    overrides: tuple[tuple[str, Any], ...] = ()
    seed: int = 0

    @property
    def family(self) -> str:
        return family_of(self.preset)

    @property
    def added_layers(self) -> int:
        return self.big - self.small

    def changes(self, n_layer: int) -> dict[str, Any]:
        """The preset field changes of the file with ``n_layer`` layers (ConfigError for a
        pair that does not fit: counts, pattern, leading layers)."""
        fam = self.family
        if not 1 <= self.small < self.big:
            raise ConfigError(f"--layers {self.small},{self.big}: need 1 <= small < big.")
        base = family_module(fam).PRESETS[self.preset]
        changes = dict(self.overrides)
        if fam == "deepseek4":
            pattern = self.pattern or tuple(changes.pop("compress_ratios", base.compress_ratios))
            if not pattern:
                raise ConfigError("--pattern: at least one compress ratio.")
            if (self.big - self.small) % len(pattern):
                raise ConfigError(
                    f"--layers {self.small},{self.big}: the added {self.big - self.small} layer(s) are "
                    f"not whole repetitions of the {len(pattern)}-layer pattern "
                    f"{','.join(map(str, pattern))}."
                )
            lead = min(base.hash_layers, self.small) if self.lead_layers is None else self.lead_layers
            if not 0 <= lead <= self.small:
                raise ConfigError(
                    f"--lead-layers {lead}: hash-routed layers must be in 0..{self.small} "
                    "(the small file's layer count)."
                )
            changes["compress_ratios"] = tuple(pattern[i % len(pattern)] for i in range(n_layer))
            changes["hash_layers"] = lead
        else:
            if self.pattern is not None:
                raise ConfigError(f"--pattern is for deepseek4 presets ({self.preset} is a {fam} preset).")
            changes["n_layer"] = n_layer
            if fam == "deepseek2":
                lead = (
                    min(base.n_dense_lead, self.small - 1) if self.lead_layers is None else self.lead_layers
                )
                if not 0 <= lead < self.small:
                    raise ConfigError(
                        f"--lead-layers {lead}: dense layers must be in 0..{self.small - 1} "
                        "(fewer than the small file's layers)."
                    )
                changes["n_dense_lead"] = lead
            elif self.lead_layers is not None:
                raise ConfigError(
                    f"--lead-layers is for deepseek2/deepseek4 presets ({self.preset}: every layer alike)."
                )
        return changes

    def resolved(self, n_layer: int) -> Any:
        """The validated preset dataclass of the file with ``n_layer`` layers."""
        return family_module(self.family).resolve_preset(self.preset, **self.changes(n_layer))

    @property
    def tensor_types(self) -> str:
        """The per-tensor type recipe of both files ("" : the preset's types)."""
        return str(dict(self.overrides).get("tensor_types", ""))

    def file_name(self, n_layer: int) -> str:
        """``PRESET[-RECIPE]-L{n}-{digest}.gguf``: RECIPE is :func:`recipe_tag` of the recipe
        (none without one); the digest covers every field of the resolved preset, the seed and
        the recipe with named recipes written out, so a changed field or recipe definition
        never reuses a stale file."""
        from moe_service.synth.recipe import expand_tensor_types, recipe_tag

        p = self.resolved(n_layer)
        key: tuple[Any, ...] = (dataclasses.asdict(p), self.seed)
        if self.tensor_types:
            key += (expand_tensor_types(self.tensor_types),)
        digest = hashlib.sha256(repr(key).encode()).hexdigest()[:10]
        tag = recipe_tag(self.tensor_types)
        return f"{self.preset}{'-' + tag if tag else ''}-L{n_layer}-{digest}.gguf"

    def check_recipe(self) -> None:
        """Apply the recipe to both files' tensor plans without writing (ConfigError naming a
        rule that matches no tensor, or a tensor whose row the rule's type does not fit)."""
        from moe_service.synth.recipe import apply_tensor_types

        if not self.tensor_types:
            return
        mod = family_module(self.family)
        for n in (self.small, self.big):
            p = self.resolved(n)
            apply_tensor_types(
                mod.tensor_plan(p), self.tensor_types, f"--per-layer {self.preset} ({n} layers)"
            )

    def write(self, pair_dir: Path, progress: Callable[[str], None] | None = None) -> tuple[Path, Path]:
        """Both files in ``pair_dir`` (written if absent, atomically by the writers); returns
        (small path, big path)."""
        pair_dir.mkdir(parents=True, exist_ok=True)
        mod = family_module(self.family)
        writer = {"deepseek4": "write_deepseek4", "deepseek2": "write_deepseek2", "synth": "write_synthetic"}
        out = []
        for n in (self.small, self.big):
            path = pair_dir / self.file_name(n)
            if not path.is_file():
                if progress:
                    progress(f"writing {path}")
                getattr(mod, writer[self.family])(path, self.resolved(n), seed=self.seed)
            out.append(path)
        return out[0], out[1]

    def describe(self) -> str:
        p = self.resolved(self.small)
        if self.family == "deepseek4":
            pat = self.pattern or tuple(
                dict(self.overrides).get(
                    "compress_ratios", family_module("deepseek4").PRESETS[self.preset].compress_ratios
                )
            )
            text = (
                f"ratios {','.join(map(str, pat))} repeated, {p.hash_layers} hash-routed layer(s) in both, "
                f"{p.n_expert} experts top-{p.n_expert_used} {p.expert_type}"
            )
        elif self.family == "deepseek2":
            text = f"{p.n_dense_lead} dense layer(s) in both, {p.n_expert} experts top-{p.n_expert_used} {p.expert_type}"
        else:
            text = f"{p.arch}, {p.n_expert} experts top-{p.n_expert_used} {p.expert_type}"
        return f"{text}, tensor types {self.tensor_types}" if self.tensor_types else text


# ---------------------------------------------------------------------------------------
# arithmetic


def per_layer_s(small_s: float, big_s: float, small_layers: int, big_layers: int) -> float:
    """(big_s - small_s) / (big_layers - small_layers): the time one more layer adds (negative
    when noise exceeds the difference). ValueError unless big_layers > small_layers."""
    if big_layers <= small_layers:
        raise ValueError(f"big_layers {big_layers} must exceed small_layers {small_layers}")
    return (big_s - small_s) / (big_layers - small_layers)


def _best_peer(row: dict, what: str) -> float | None:
    """The faster llama.cpp configuration's tok/s of one round's peer row (None if none ran)."""
    return max(
        (x for x in (row.get(f"llamacpp_{what}_tok_s"), row.get(f"llamacpp_fa_{what}_tok_s")) if x),
        default=None,
    )


def per_layer_row(
    depth: int,
    small_rounds: list[dict],
    big_rounds: list[dict],
    small_layers: int,
    big_layers: int,
    n_decode: int,
) -> dict:
    """One depth's per-layer row from matched rounds of the two files.

    Each round dict (one file, one depth, one round) holds ``prefill_tok_s`` / ``decode_tok_s``
    (ours) and ``llamacpp_*_tok_s`` / ``llamacpp_fa_*_tok_s`` (None or absent where not run).
    Per round: seconds per decoded token (1 / tok/s) and seconds of the D-token prefill
    (D / tok/s) of each file, :func:`per_layer_s` of each engine, and the ratio llama.cpp /
    ours where both per-layer times are positive. The row holds the medians over rounds:
    ``{ours,llamacpp}_decode_ms_per_layer`` (per decoded token), ``*_prefill_ms_per_layer``
    (the whole D-token prefill), ``decode_ratio`` / ``prefill_ratio`` (median of the rounds'
    ratios), each with ``*_runs``; and the whole files' tok/s and ratios (``small_*``,
    ``big_*``: medians).

    Best of rounds: ``{ours,llamacpp}_{what}_ms_per_layer_best`` is :func:`per_layer_s` of
    each file's fastest round (per engine), and ``{what}_ratio_best`` their ratio. On a shared
    host another process only ever adds time, so the fastest round is the estimate least
    touched by the load; it is reported beside the median, not instead of it."""
    row: dict[str, Any] = {"depth": depth, "n_decode": n_decode}
    n = min(len(small_rounds), len(big_rounds))
    for what, work in (("decode", 1.0), ("prefill", float(depth))):
        ours_pl, peer_pl, ratios = [], [], []
        for s, b in zip(small_rounds[:n], big_rounds[:n], strict=True):
            if not s.get(f"{what}_tok_s") or not b.get(f"{what}_tok_s"):
                continue
            o = per_layer_s(work / s[f"{what}_tok_s"], work / b[f"{what}_tok_s"], small_layers, big_layers)
            ours_pl.append(o)
            ps, pb = _best_peer(s, what), _best_peer(b, what)
            if ps and pb:
                p = per_layer_s(work / ps, work / pb, small_layers, big_layers)
                peer_pl.append(p)
                if o > 0 and p > 0:
                    ratios.append(p / o)
        if ours_pl:
            row[f"ours_{what}_ms_per_layer"] = statistics.median(ours_pl) * 1e3
            row[f"ours_{what}_ms_per_layer_runs"] = [x * 1e3 for x in ours_pl]
        if peer_pl:
            row[f"llamacpp_{what}_ms_per_layer"] = statistics.median(peer_pl) * 1e3
            row[f"llamacpp_{what}_ms_per_layer_runs"] = [x * 1e3 for x in peer_pl]
        if ratios:
            row[f"{what}_ratio"] = statistics.median(ratios)
            row[f"{what}_ratio_runs"] = ratios
        best: dict[str, float] = {}
        for eng in ("ours", "llamacpp"):
            vs = tuple(
                [r.get(f"{what}_tok_s") if eng == "ours" else _best_peer(r, what) for r in rounds]
                for rounds in (small_rounds[:n], big_rounds[:n])
            )
            if all(v for v in vs[0]) and all(v for v in vs[1]) and vs[0]:
                best[eng] = per_layer_s(work / max(vs[0]), work / max(vs[1]), small_layers, big_layers)
                row[f"{eng}_{what}_ms_per_layer_best"] = best[eng] * 1e3
        if len(best) == 2 and best["ours"] > 0 and best["llamacpp"] > 0:
            row[f"{what}_ratio_best"] = best["llamacpp"] / best["ours"]
        for tag, rounds in (("small", small_rounds[:n]), ("big", big_rounds[:n])):
            ours_v = [r[f"{what}_tok_s"] for r in rounds if r.get(f"{what}_tok_s")]
            peer_v = [_best_peer(r, what) for r in rounds]
            if ours_v:
                row[f"{tag}_{what}_tok_s"] = statistics.median(ours_v)
            if any(peer_v):
                row[f"{tag}_llamacpp_{what}_tok_s"] = statistics.median([v for v in peer_v if v])
                file_ratios = [
                    r[f"{what}_tok_s"] / v
                    for r, v in zip(rounds, peer_v, strict=True)
                    if v and r.get(f"{what}_tok_s")
                ]
                if file_ratios:
                    row[f"{tag}_{what}_ratio"] = statistics.median(file_ratios)
    return row


# ---------------------------------------------------------------------------------------
# running


def run_per_layer(
    pair: LayerPair,
    pair_dir: Path,
    threads: int,
    depths: list[int],
    n_decode: int,
    ubatch: int,
    peer: bool,
    flash_attn: str = "off",
    n_batch: int = 512,
    kv_type: str = "f16",
    rounds: int = 1,
) -> dict:
    """Write (or reuse) the pair, then ``rounds`` rounds of: the small file's depth run, the
    big file's (bench.decode.run_depths, one round each: both engines back to back per
    depth); the per-layer rows (:func:`per_layer_row`) per depth."""
    import os

    from bench.decode import run_depths

    def say(msg: str) -> None:
        print(f"  {msg}", file=sys.stderr, flush=True)

    small_path, big_path = pair.write(pair_dir, progress=say)
    per_file: dict[str, dict[int, list[dict]]] = {
        "small": {d: [] for d in depths},
        "big": {d: [] for d in depths},
    }
    for rnd in range(rounds):
        for tag, path in (("small", small_path), ("big", big_path)):
            say(f"round {rnd + 1}/{rounds}: {path.name}")
            r = run_depths(
                path, threads, depths, n_decode, ubatch, peer, flash_attn, n_batch, kv_type, repeats=1
            )
            for row in r["rows"]:
                per_file[tag][row["depth"]].append(row)
            # the engine's model sits in reference cycles, and its weight arena (an mmap) is
            # invisible to the collector's thresholds: without this each round's arenas stayed
            # mapped (a 9-round qwen3moe pair reached 8 GB resident)
            gc.collect()
    rows = []
    for d in depths:
        if any("decode_tok_s" not in x for x in per_file["small"][d] + per_file["big"][d]):
            reason = next(
                (x.get("reason") for x in per_file["small"][d] + per_file["big"][d] if x.get("reason")),
                "not measured",
            )
            rows.append({"depth": d, "reason": reason})
            continue
        row = per_layer_row(d, per_file["small"][d], per_file["big"][d], pair.small, pair.big, n_decode)
        reason = next((x["llamacpp"] for x in per_file["small"][d] if "llamacpp" in x), None)
        if reason:
            row["llamacpp"] = reason
        rows.append(row)
    return {
        "preset": pair.preset,
        "family": pair.family,
        "describe": pair.describe(),
        "tensor_types": pair.tensor_types,
        "small_layers": pair.small,
        "big_layers": pair.big,
        "files": [str(small_path), str(big_path)],
        "threads": threads,
        "n_decode": n_decode,
        "ubatch": ubatch,
        "n_batch": n_batch,
        "kv_type": kv_type,
        "flash_attn": flash_attn,
        "rounds": rounds,
        "rows": rows,
        "load_average": list(os.getloadavg()),
    }


def _f(v: float | None, spec: str = ".2f") -> str:
    return "n/a" if v is None else format(v, spec)


def format_per_layer(r: dict) -> str:
    """The per-layer table, then the whole files' tok/s and ratios per depth."""
    lines = [
        f"bench decode --per-layer {r['preset']}: {r['small_layers']} vs {r['big_layers']} layers "
        f"({r['describe']}), {r['threads']} thread(s), decode {r['n_decode']} tokens, {r['rounds']} round(s), "
        f"load average {r['load_average'][0]:.2f}",
        "",
        "per layer (ms; decode: per decoded token, prefill: the whole D-token prefill; ratio: llama.cpp / ours)",
        f"{'depth':>6}  {'decode ours':>11}  {'llama.cpp':>9}  {'ratio':>5}  {'prefill ours':>12}  "
        f"{'llama.cpp':>9}  {'ratio':>5}",
    ]
    for row in r["rows"]:
        if "reason" in row:
            lines.append(f"{row['depth']:>6}  {row['reason']}")
            continue
        lines.append(
            f"{row['depth']:>6}  {_f(row.get('ours_decode_ms_per_layer')):>11}  "
            f"{_f(row.get('llamacpp_decode_ms_per_layer')):>9}  {_f(row.get('decode_ratio')):>5}  "
            f"{_f(row.get('ours_prefill_ms_per_layer'), '.1f'):>12}  "
            f"{_f(row.get('llamacpp_prefill_ms_per_layer'), '.1f'):>9}  {_f(row.get('prefill_ratio')):>5}"
        )
    if r["rounds"] > 1:
        lines += ["", "per layer, each file's fastest round (ms; ratio: llama.cpp / ours)"]
        for row in r["rows"]:
            if "reason" in row:
                continue
            lines.append(
                f"{row['depth']:>6}  {_f(row.get('ours_decode_ms_per_layer_best')):>11}  "
                f"{_f(row.get('llamacpp_decode_ms_per_layer_best')):>9}  {_f(row.get('decode_ratio_best')):>5}  "
                f"{_f(row.get('ours_prefill_ms_per_layer_best'), '.1f'):>12}  "
                f"{_f(row.get('llamacpp_prefill_ms_per_layer_best'), '.1f'):>9}  {_f(row.get('prefill_ratio_best')):>5}"
            )
    lines += [
        "",
        "whole files (tok/s ours / llama.cpp, ratio ours / llama.cpp)",
        f"{'depth':>6}  {'layers':>6}  {'decode ours':>11}  {'llama.cpp':>9}  {'ratio':>5}  "
        f"{'prefill ours':>12}  {'llama.cpp':>9}  {'ratio':>5}",
    ]
    for row in r["rows"]:
        if "reason" in row:
            continue
        for tag in ("small", "big"):
            lines.append(
                f"{row['depth']:>6}  {r[f'{tag}_layers']:>6}  {_f(row.get(f'{tag}_decode_tok_s'), '.1f'):>11}  "
                f"{_f(row.get(f'{tag}_llamacpp_decode_tok_s'), '.1f'):>9}  "
                f"{_f(row.get(f'{tag}_decode_ratio')):>5}  {_f(row.get(f'{tag}_prefill_tok_s'), '.1f'):>12}  "
                f"{_f(row.get(f'{tag}_llamacpp_prefill_tok_s'), '.1f'):>9}  "
                f"{_f(row.get(f'{tag}_prefill_ratio')):>5}"
            )
    reasons = {row["llamacpp"] for row in r["rows"] if "llamacpp" in row}
    for reason in reasons:
        lines.append(f"llama.cpp: {reason}")
    if r["rounds"] > 1:
        lines.append("per-layer times: medians of the rounds; ratios: the median of the rounds' ratios")
    return "\n".join(lines)
