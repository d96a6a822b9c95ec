"""Re-plan with measured interactions between downgrades.

The planner adds isolated cells: a recipe's damage is taken to be the sum of what each group does
alone. The additivity audit (docs/benchmarks.md) measures how far that is off. Refinement measures
it for one recipe, where it matters: the recipe as a whole on the map's calibration tokens, then,
for the heaviest downgrades, what restoring each one to its least-damaging format buys in the
company of all the others. A group whose downgrade costs more in context than alone (its error
compounds with its neighbours') has its damage row scaled up by that ratio, one that costs less
is scaled down, and the plan is solved again. The new recipe is kept only when it measures better
as a whole, so refinement never returns a recipe that measures worse on those tokens.
"""

from __future__ import annotations

import copy
from pathlib import Path

import torch

from .errors import CardfitError
from .formats import get_format
from .engine.metrics import DistanceMeter
from .groups import GroupId
from .sources import ModelSource

RATIO_LIMITS = (0.25, 4.0)  # a measured in-context/isolated ratio outside this is clamped


class RecipeMeter:
    """Measures whole recipes (every group in its format, the formats' real quantizers) against the
    reference on fixed token chunks, on the engine: many recipes walk as tracks, one layer read for all."""

    def __init__(self, source: ModelSource, chunks: torch.Tensor, group_by: str, rounding: str,
                 device: str = "auto", batch: int = 4, dtype: str = "auto"):
        from .engine.activations import ActivationCache
        from .engine import Engine
        from .groups import scan_groups
        from .scan.measure import Scanner

        self.engine = Engine(source, device, dtype)
        self.stream = self.engine.stream
        self.cache = ActivationCache(None)
        self.scanner = Scanner(source, self.engine, chunks, batch, self.cache, rounding)
        self.reference = self.scanner.reference()
        self.groups = {g.name: g for g in scan_groups(source, group_by)}
        self.layers = self.scanner.layers
        self._stats: dict[tuple[str, str], dict] = {}

    def _quantized(self, assignment: dict[str, str], start: int) -> dict[str, torch.Tensor]:
        """The quantized tensors of every group that enters the forward at `start`."""
        out = {}
        for name, group in self.groups.items():
            if group.start != start or name not in assignment:
                continue
            fmt = get_format(assignment[name])
            key = (name, fmt.method_for(self.scanner.rounding))  # statistics depend on the rounding only
            if key not in self._stats:
                self._stats[key] = self.scanner.calibration(group, [fmt])
            out.update(self.scanner.quantized(group, fmt, self._stats[key]))
        return out

    def _track(self, assignment: dict[str, str], start: int, inputs: dict[int, list[torch.Tensor]] | None, key):
        from .engine import Track

        embedding = self._quantized(assignment, -1) if start < 0 or inputs is None or self.stream.tied else {}
        if start < 0 or inputs is None:
            hidden = self.engine.embed(self.scanner.batches, embedding)
            start = 0
        else:
            hidden = list(inputs[start])
        head = self._quantized(assignment, self.layers)
        if self.stream.tied:
            head.update(embedding)  # the tied output matrix is the embedding, in its format

        def replacements(group: str) -> dict[str, torch.Tensor]:
            layer = GroupId(group).layer
            if layer is not None:
                return self._quantized(assignment, layer)
            return head

        return Track(hidden, start, replacements, key)

    @torch.no_grad()
    def measure_many(self, trials: list[tuple[dict[str, str], int]], inputs: dict[int, list[torch.Tensor]] | None
                     ) -> list[DistanceMeter]:
        """KL of each (assignment, start) against the reference, all in one walk; a trial starts from
        `inputs[start]` (that layer's input under an assignment equal to it before `start`)."""
        tracks = [self._track(a, s, inputs, k) for k, (a, s) in enumerate(trials)]
        self.engine.walk(tracks)
        meters = self.scanner.head_distances(tracks)
        return [meters[k] for k in range(len(trials))]

    @torch.no_grad()
    def measure(self, assignment: dict[str, str], start: int = -1,
                inputs: dict[int, list[torch.Tensor]] | None = None, keep_inputs: bool = False
                ) -> tuple[DistanceMeter, dict[int, list[torch.Tensor]]]:
        """KL of the recipe against the reference; from layer `start` when `inputs` holds that layer's
        input under the same assignment (a group changed there re-runs only from its layer on)."""
        kept: dict[int, list[torch.Tensor]] = {}
        track = self._track(assignment, start, inputs, 0)

        def keep(i, active):
            if keep_inputs:
                kept[i] = active[0].hidden

        self.engine.walk([track], before_layer=keep)
        if keep_inputs:
            kept[self.layers] = track.hidden
        return self.scanner.head_distances([track])[0], kept

    def close(self) -> None:
        self.cache.close()
        self.engine.close()


def _restore_target(group: dict, formats: list[str]) -> str:
    """The group's least-damaging format in the map (ties: the larger)."""
    return min(formats, key=lambda f: (group["cells"][f]["damage"], -group["bytes"][f]))


def refine(recipe: dict, map_data: dict, model: str | Path | None = None, calibration: str | Path | None = None,
           top: int = 8, rounds: int = 1, device: str = "auto", log=None, max_tokens: int | None = None) -> dict:
    """A recipe planned with measured interactions, or the same recipe when that does not measure better.

    Measures on the map's own calibration text (pass it when it was not the bundled one), over the
    map's token count or `max_tokens` of it: more tokens than the map's guard against fitting the
    re-plan to the calibration sample. Returns the recipe with a `refinement` record."""
    from .maps import check_map_model
    from .plan import map_hash, plan
    from .sources import open_model
    from .text import load_text, load_tokenizer, text_hash, token_chunks

    if top < 1 or rounds < 1:
        raise CardfitError("--top and --rounds must be at least 1", "e.g. --top 8 --rounds 1")
    if recipe.get("source") == "uniform" or recipe["map"].get("sha256") != map_hash(map_data):
        raise CardfitError("the recipe was not planned from this map", "refine the recipe with the map it came from")
    source = open_model(model, run=True)
    check_map_model(map_data, source)
    text, text_path = load_text(calibration)
    calib = map_data["calibration"]
    if text_hash(text) != calib["sha256"]:
        raise CardfitError(f"{text_path.name} is not the text the map was scanned on ({calib['source']})",
                           "pass --calibration with the map's own calibration text")
    tokenizer = load_tokenizer(str(source.path))
    chunks = token_chunks(tokenizer, text, calib["seq_len"], max_tokens or calib["tokens"], source=str(text_path),
                          rows=source.embedding_rows())
    formats = list(map_data["formats"])
    by_name = {g["name"]: g for g in map_data["groups"]}
    meter = RecipeMeter(source, chunks, map_data["group_by"], map_data["rounding"], device)
    budget, reserve = recipe["budget"]["weight_budget_bytes"], recipe["reserved_bytes"]
    served = recipe.get("served_by")
    try:
        best = recipe
        assignment = {g["name"]: g["format"] for g in recipe["groups"]}
        measured, inputs = meter.measure(assignment, keep_inputs=True)
        start_kl = best_kl = measured.kl
        corrected = copy.deepcopy(map_data)
        ratios: dict[str, float] = {}
        savings: dict[str, dict] = {}
        history = []
        for _ in range(rounds):
            costs = []
            for name, fmt in assignment.items():
                target = _restore_target(by_name[name], formats)
                isolated = by_name[name]["cells"][fmt]["damage"] - by_name[name]["cells"][target]["damage"]
                if fmt != target and isolated > 0 and name not in ratios:
                    costs.append((isolated, name, target))
            if not costs:
                break
            chosen = sorted(costs, reverse=True)[:top]
            trials = [(dict(assignment, **{name: target}), meter.groups[name].start) for _, name, target in chosen]
            for (isolated, name, target), restored in zip(chosen, meter.measure_many(trials, inputs)):
                ratio = (best_kl - restored.kl) / isolated
                ratios[name] = min(max(ratio, RATIO_LIMITS[0]), RATIO_LIMITS[1])
                savings[name] = {"restored_to": target, "in_context": best_kl - restored.kl, "alone": isolated}
                base = by_name[name]["cells"][target]["damage"]
                for f in formats:
                    cell = _group(corrected, name)["cells"][f]
                    cell["damage"] = max(0.0, base + ratios[name] * (by_name[name]["cells"][f]["damage"] - base))
                if log:
                    log(f"{name}: {assignment[name]} -> {target} saves {best_kl - restored.kl:.5f} in context, "
                        f"{isolated:.5f} alone (ratio {ratio:.2f})")
            limits = recipe.get("constraints") or {}
            candidate = plan(corrected, budget, limits.get("formats"), limits.get("pins"), limits.get("floors"),
                             reserve_bytes=reserve, runtime=served)
            new_assignment = {g["name"]: g["format"] for g in candidate["groups"]}
            if new_assignment == assignment:
                history.append({"changed_groups": 0, "measured": best_kl})
                break
            new_measured, new_inputs = meter.measure(new_assignment, keep_inputs=True)
            changed = sum(new_assignment[n] != assignment[n] for n in assignment)
            history.append({"changed_groups": changed, "measured": new_measured.kl})
            if log:
                log(f"re-planned: {changed} groups changed, measured {best_kl:.5f} -> {new_measured.kl:.5f}")
            if new_measured.kl >= best_kl:
                break
            best, assignment, inputs, best_kl = candidate, new_assignment, new_inputs, new_measured.kl
    finally:
        meter.close()
    out = copy.deepcopy(best)
    if out is not recipe:
        out["map"]["sha256"] = recipe["map"]["sha256"]  # planned from a corrected copy of this map
    out["refinement"] = {"calibration_tokens": int(chunks.numel()), "top": top, "rounds": rounds,
                         "measured_before": start_kl, "measured_after": best_kl, "kept": best is not recipe,
                         "ratios": ratios, "savings": savings, "history": history,
                         "metric": "mean KL(P_ref || P_recipe) on the map's calibration tokens, "
                                   "every group quantized at once"}
    return out


def _group(data: dict, name: str) -> dict:
    return next(g for g in data["groups"] if g["name"] == name)


from .stage import callable_stage  # noqa: E402

callable_stage(__name__)
