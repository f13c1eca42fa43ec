"""Each pruning method on a case small enough to work out by hand, through `run_pruning`,
plus exact-target sparsity and 2:4 validity on the tiny Llama."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from torch import nn

from harness.config import PER_ROW_BASES, PRUNE_METHOD_FACTS, PRUNE_METHODS, PruneConfig
from harness.distributed import Collectives
from harness.models import build_model, decoder_blocks
from harness.pruning import run_pruning
from harness.pruning.experimental import exact_keys
from harness.pruning.layout import Layout
from harness.pruning.methods import Rule, select, veto_keys
from harness.pruning.registry import METHODS as REGISTRY
from harness.pruning.registry import method_of
from harness.pruning.select import count_for


class ToyBlock(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(x)


class Toy(nn.Module):
    """One 'decoder block' holding one Linear, declared as transformers models declare theirs, so
    target discovery works as on an HF model."""

    _no_split_modules = ["ToyBlock"]

    def __init__(self, weight: list[list[float]]) -> None:
        super().__init__()
        w = torch.tensor(weight)
        self.model = nn.Module()
        self.model.layers = nn.ModuleList([ToyBlock()])
        self.model.layers[0].proj = nn.Linear(w.shape[1], w.shape[0], bias=False)
        with torch.no_grad():
            self.model.layers[0].proj.weight.copy_(w)

    @property
    def weight(self) -> torch.Tensor:
        return self.model.layers[0].proj.weight.detach()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.model.layers[0](x)


def pruned(model: Toy) -> set[tuple[int, int]]:
    return {tuple(ij) for ij in (model.weight == 0).nonzero().tolist()}


W = [[0.5, -2.0, 0.1, 3.0], [-1.0, 0.2, 4.0, -0.3]]


def forward_loss(m: Toy, x: torch.Tensor) -> torch.Tensor:
    return m(x).pow(2).mean()


def test_magnitude_hand_case() -> None:
    toy = Toy(W)
    report = run_pruning(toy, [], PruneConfig(method="magnitude", sparsity=0.5), forward_loss)
    # the four smallest |w|: 0.1 (0,2), 0.2 (1,1), 0.3 (1,3), 0.5 (0,0)
    assert pruned(toy) == {(0, 2), (1, 1), (1, 3), (0, 0)}
    assert report.achieved_sparsity == 0.5
    assert report.fwd_passes == 0 and report.fwd_bwd_passes == 0


def test_wanda_hand_case() -> None:
    toy = Toy(W)
    # tokens x1 = [1,0,0,2], x2 = [1,0,1,0]: ||X_j|| = [sqrt2, 0, 1, 2]
    x = torch.tensor([[[1.0, 0.0, 0.0, 2.0], [1.0, 0.0, 1.0, 0.0]]])
    run_pruning(toy, [x], PruneConfig(method="wanda", sparsity=0.5), forward_loss)
    # row 0 scores [0.707, 0, 0.1, 6] -> prune cols 1, 2; row 1 [1.414, 0, 4, 0.6] -> cols 1, 3
    # (magnitude alone would prune cols 0 and 2 of row 0)
    assert pruned(toy) == {(0, 1), (0, 2), (1, 1), (1, 3)}


def test_sparsegpt_hand_case() -> None:
    toy = Toy([[3.0, 1.0], [0.5, 2.0]])
    # tokens [1,1], [1,0], [0,1]: H = X^T X = [[2,1],[1,2]]; 1% dampening of mean diag -> H' = H + 0.02 I
    x = torch.tensor([[[1.0, 1.0], [1.0, 0.0], [0.0, 1.0]]])
    run_pruning(toy, [x], PruneConfig(method="sparsegpt", sparsity=0.5), forward_loss)
    h = [[2.02, 1.0], [1.0, 2.02]]
    det = h[0][0] * h[1][1] - h[0][1] * h[1][0]
    hinv00 = h[1][1] / det
    # OBS saliency w_j^2 / [H'^-1]_jj-after-elimination: col 0 uses [H'^-1]_00, the last col 1/H'_11
    scores = {(0, 0): 9.0 / hinv00, (0, 1): 1.0 * h[1][1], (1, 0): 0.25 / hinv00, (1, 1): 4.0 * h[1][1]}
    expected = set(sorted(scores, key=scores.get)[:2])
    assert expected == {(1, 0), (0, 1)}
    assert pruned(toy) == expected
    # row 0 lost its last column: nothing to compensate; row 1 lost col 0:
    # w_11 += -w_10 * [H'^-1]_10 / [H'^-1]_00 = 2 + 0.5 * H'_01 / H'_11
    torch.testing.assert_close(toy.weight, torch.tensor([[3.0, 0.0], [0.0, 2.0 + 0.5 * h[0][1] / h[1][1]]]))


def probe_loss(m: Toy, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    x, t = batch
    return 0.5 * (m(x) - t).pow(2).sum()


# L_b = (w.x_b - t_b)^2 / 2, so dL/dw = r_b x_b with r_b = w.x_b - t_b.
PROBE_W = [[1.0, 2.0, 3.0, 4.0]]
PROBE_BATCHES = [
    (torch.tensor([[1.0, 0.0, 0.0, 0.0]]), torch.tensor([[2.0]])),
    (torch.tensor([[0.0, 1.0, 1.0, 0.0]]), torch.tensor([[3.0]])),
]


def hand_g(w: list[float]) -> list[float]:
    """max over the two batches of |r_b x_b| (every value here is exact in bf16)."""
    out = [0.0] * 4
    for x, t in PROBE_BATCHES:
        r = sum(a * b for a, b in zip(w, x[0].tolist())) - float(t)
        out = [max(o, abs(r * xi)) for o, xi in zip(out, x[0].tolist())]
    return out


@pytest.mark.parametrize("threshold", [0.0, 0.6])
def test_gradprobe_original_mode_hand_case(threshold: float) -> None:
    toy = Toy(PROBE_W)
    cfg = PruneConfig(
        method="gradprobe", base="magnitude", decision="veto", sparsity=0.5, reduction=0.5, threshold=threshold, exact_target=False
    )
    report = run_pruning(toy, PROBE_BATCHES, cfg, probe_loss)
    w = PROBE_W[0]
    candidates = [0, 1]  # the two smallest |w|
    g0 = hand_g(w)  # [1, 2, 2, 0]
    g1 = hand_g([w[0] * 0.5, w[1] * 0.5, w[2], w[3]])  # [1.5, 1, 1, 0]
    expected = {(0, j) for j in candidates if g1[j] <= g0[j] * (1 + threshold)}
    assert expected == ({(0, 1)} if threshold == 0.0 else {(0, 0), (0, 1)})  # the veto bites only at 0
    assert pruned(toy) == expected
    assert report.achieved_sparsity == len(expected) / 4
    assert report.fwd_bwd_passes == 2  # G0 and G1: one pass each for the whole (one-group) model


def test_gradprobe_exact_mode_hand_case() -> None:
    toy = Toy(PROBE_W)
    cfg = PruneConfig(method="gradprobe", base="magnitude", sparsity=0.5, reduction=0.5, exact_target=True, decision="rank")
    report = run_pruning(toy, PROBE_BATCHES, dataclasses.replace(cfg, pool=0.5), probe_loss)
    w = PROBE_W[0]
    pool = [0, 1, 2]  # floor(0.5 * 1.5 * 4) = 3 smallest |w|
    g0 = hand_g(w)  # [1, 2, 2, 0]
    g1 = hand_g([w[0] * 0.5, w[1] * 0.5, w[2] * 0.5, w[3]])  # [1.5, 0.5, 0.5, 0]
    ratio = {j: g1[j] / g0[j] for j in pool}  # {0: 1.5, 1: 0.25, 2: 0.25}
    keep_worst = sorted(pool, key=lambda j: (ratio[j], abs(w[j]), j))[:2]
    assert sorted(keep_worst) == [1, 2]  # w0's gradient grew 1.5x: it is the offender kept
    assert pruned(toy) == {(0, j) for j in keep_worst}
    assert report.achieved_sparsity == 0.5


def lm_loss(model: nn.Module, batch: torch.Tensor) -> torch.Tensor:
    return model(input_ids=batch, labels=batch).loss


def calib() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    return [torch.randint(0, 2048, (2, 16), generator=g) for _ in range(2)]


METHODS = [
    ("magnitude", {}),
    ("wanda", {}),
    ("sparsegpt", {}),
    ("gradprobe", {"base": "wanda", "decision": "veto"}),
    ("gradprobe", {"base": "magnitude", "decision": "veto"}),
    ("gradprobe", {"base": "ria", "decision": "veto"}),
    ("gradprobe", {"base": "gblm", "decision": "veto"}),
    ("gradprobe", {"base": "taylor", "decision": "veto"}),
]


def target_linears(model: nn.Module) -> list[nn.Linear]:
    return [m for b in decoder_blocks(model) for m in b.modules() if isinstance(m, nn.Linear)]


def grouped(method: str, k: int) -> dict:
    """GradProbe's K blocks per group; the other methods go one decoder block at a time and read no K."""
    return {"group_size": k} if method == "gradprobe" else {}


@pytest.mark.parametrize("method,extra", METHODS)
def test_exact_target_sparsity(method: str, extra: dict) -> None:
    model = build_model("tiny-llama")
    sparsity = 0.37
    report = run_pruning(model, calib(), PruneConfig(method=method, sparsity=sparsity, **grouped(method, 1), **extra), lm_loss)
    per_row = method == "wanda" or extra.get("base") in PER_ROW_BASES
    for lin in target_linears(model):
        rows, cols = lin.weight.shape
        zeros = lin.weight == 0
        if per_row:
            assert torch.all(zeros.sum(1) == count_for(sparsity, cols))
        else:
            assert int(zeros.sum()) == count_for(sparsity, rows * cols)
    expected = sum(
        (lin.weight.shape[0] * count_for(sparsity, lin.weight.shape[1])) if per_row else count_for(sparsity, lin.weight.numel())
        for lin in target_linears(model)
    )
    assert report.achieved_sparsity == expected / sum(lin.weight.numel() for lin in target_linears(model))
    assert {x.name for x in report.layers} == {n for n, m in model.named_modules() if m in target_linears(model)}


@pytest.mark.parametrize("method,extra", METHODS)
def test_two_four_validity(method: str, extra: dict) -> None:
    model = build_model("tiny-llama")
    report = run_pruning(model, calib(), PruneConfig(method=method, pattern="2:4", sparsity=0.5, **grouped(method, 2), **extra), lm_loss)
    for lin in target_linears(model):
        nonzero_per_group = (lin.weight != 0).reshape(-1, 4).sum(1)
        assert torch.all(nonzero_per_group == 2), lin
    assert report.achieved_sparsity == 0.5
    # untouched: embeddings and the LM head are not targets
    assert int((model.lm_head.weight == 0).sum()) == 0
    assert int((model.model.embed_tokens.weight == 0).sum()) == 0


def test_gradprobe_original_mode_undershoots_and_stays_within_candidates() -> None:
    dense = build_model("tiny-llama")
    model = build_model("tiny-llama")
    cfg = PruneConfig(method="gradprobe", base="magnitude", decision="veto", sparsity=0.5, exact_target=False, group_size=0)
    report = run_pruning(model, calib(), cfg, lm_loss)
    mag = build_model("tiny-llama")
    run_pruning(mag, [], PruneConfig(method="magnitude", sparsity=0.5), lm_loss)
    vetoed = 0
    for a, b, d in zip(target_linears(model), target_linears(mag), target_linears(dense)):
        assert torch.all((a.weight == 0) <= (b.weight == 0))  # pruned only among magnitude's candidates
        vetoed += int(((b.weight == 0) & (a.weight != 0)).sum())
        kept = a.weight != 0
        assert torch.equal(a.weight[kept], d.weight[kept])  # the probe restored every weight exactly
    assert vetoed > 0 and report.achieved_sparsity < 0.5
    assert report.achieved_sparsity == 0.5 - vetoed / sum(x.numel for x in report.layers)


def test_refusals_are_explicit() -> None:
    model = build_model("tiny-llama")
    with pytest.raises(ValueError, match="exact_target"):
        run_pruning(model, calib(), PruneConfig(method="gradprobe", decision="veto", pattern="2:4", exact_target=False), lm_loss)
    with pytest.raises(ValueError, match="sparsity"):
        run_pruning(model, calib(), PruneConfig(method="magnitude", pattern="2:4", sparsity=0.6), lm_loss)
    with pytest.raises(ValueError, match="row"):
        run_pruning(model, calib(), PruneConfig(method="wanda", scope="global"), lm_loss)


# ------------------------------------------------------------------------- gradient-informed bases, veto
# With pool=0 the candidate pool is exactly the target, so the probe cannot change the base's
# choice: these runs check each base score alone, through the whole stage.


def probe_grads(w: list[float]) -> list[list[float]]:
    """Per probe step (one batch each), dL/dw = r_b x_b."""
    out = []
    for x, t in PROBE_BATCHES:
        r = sum(a * b for a, b in zip(w, x[0].tolist())) - float(t)
        out.append([r * xi for xi in x[0].tolist()])
    return out


def lowest(scores: list[float], k: int) -> set[tuple[int, int]]:
    return {(0, j) for j in sorted(range(len(scores)), key=lambda j: (scores[j], j))[:k]}


def test_taylor_base_is_weight_times_gradient_rms() -> None:
    toy = Toy(PROBE_W)
    run_pruning(toy, PROBE_BATCHES, PruneConfig(method="gradprobe", base="taylor", decision="veto", sparsity=0.5, pool=0.0), probe_loss)
    w = PROBE_W[0]
    g = probe_grads(w)  # [[-1,0,0,0], [0,2,2,0]]
    scores = [abs(w[j]) * math.sqrt(sum(step[j] ** 2 for step in g)) for j in range(4)]  # [1, 4, 6, 0]
    assert lowest(scores, 2) == {(0, 3), (0, 0)}  # magnitude would prune w0, w1; Wanda w0 and w3 as well
    assert pruned(toy) == lowest(scores, 2)


def test_gblm_base_adds_the_rescaled_gradient_term_to_wanda() -> None:
    toy = Toy(PROBE_W)
    run_pruning(toy, PROBE_BATCHES, PruneConfig(method="gradprobe", base="gblm", decision="veto", sparsity=0.25, pool=0.0), probe_loss)
    w = PROBE_W[0]
    g = probe_grads(w)
    norms = [math.sqrt(sum(x[0, j].item() ** 2 for x, _ in PROBE_BATCHES)) for j in range(4)]  # [1, 1, 1, 0]
    wanda = [abs(w[j]) * norms[j] for j in range(4)]  # [1, 2, 3, 0]
    grad = [abs(w[j]) * math.sqrt(sum(step[j] ** 2 for step in g)) for j in range(4)]  # [1, 4, 6, 0]
    scale = sum(wanda) / sum(grad)  # 6 / 11
    scores = [a + scale * b for a, b in zip(wanda, grad)]
    assert lowest(scores, 1) == {(0, 3)}
    assert pruned(toy) == lowest(scores, 1)


def test_ria_hand_case() -> None:
    toy = Toy(W)
    x = torch.tensor([[[1.0, 0.0, 0.0, 2.0], [1.0, 0.0, 1.0, 0.0]]])  # ||X_j|| = [sqrt2, 0, 1, 2]
    run_pruning(
        toy, [(x, torch.zeros(1, 2, 2))], PruneConfig(method="gradprobe", base="ria", decision="veto", sparsity=0.5, pool=0.0), probe_loss
    )
    a = [[abs(v) for v in row] for row in W]
    rows = [sum(r) for r in a]
    cols = [sum(a[i][j] for i in range(2)) for j in range(4)]
    norms = [math.sqrt(2), 0.0, 1.0, 2.0]
    expected = set()
    for i in range(2):
        score = [(a[i][j] / rows[i] + a[i][j] / cols[j]) * math.sqrt(norms[j]) for j in range(4)]
        expected |= {(i, j) for j in sorted(range(4), key=lambda j: (score[j], j))[:2]}
    # row 0: [0.433, 0, 0.057, 1.17] -> cols 1, 2; row 1: [0.635, 0, 1.84, 0.153] -> cols 1, 3 (Wanda's choice here too)
    assert expected == {(0, 1), (0, 2), (1, 1), (1, 3)}
    assert pruned(toy) == expected


def test_veto_keeps_the_base_order_where_rank_reorders() -> None:
    """Pool = the first four; the fifth has the lowest base score but is outside the pool.
    G1/G0 = [2, 0.5, 0.9, 0.1]: element 0 is vetoed (its gradient grew)."""
    layout = Layout(1, 5, 0, 5, ((0, 5),))
    pool = torch.tensor([True, True, True, True, False])
    base = torch.tensor([0.1, 0.2, 0.3, 0.4, 0.05])
    g0 = torch.ones(5, dtype=torch.bfloat16)
    rule = Rule("per_matrix", 0.4)  # floor(0.4 x 5) = 2 pruned

    def chosen(keys: torch.Tensor) -> list[int]:
        (mask,) = select(rule, [layout], [keys], Collectives(), 49)
        return mask.nonzero().flatten().tolist()

    g1 = torch.tensor([2.0, 0.5, 0.9, 0.1, 1.0], dtype=torch.bfloat16)
    assert chosen(veto_keys(pool, g0, g1, base, 0.0, None)) == [1, 2]  # the base order among those that passed
    assert chosen(exact_keys(pool, g0, g1, base, None)) == [1, 3]  # the lowest ratios
    # too few pass: the vetoed fill up, again in base order
    g1 = torch.tensor([2.0, 2.0, 2.0, 0.5, 1.0], dtype=torch.bfloat16)
    assert chosen(veto_keys(pool, g0, g1, base, 0.0, None)) == [0, 3]
    # a threshold lets a growth through, as in the original rule
    assert chosen(veto_keys(pool, g0, g1, base, 1.5, None)) == [0, 1]


@pytest.mark.parametrize("decision", ["rank", "veto"])
def test_veto_and_rank_through_the_stage(decision: str) -> None:
    toy = Toy(PROBE_W)
    cfg = PruneConfig(method="gradprobe", base="magnitude", sparsity=0.5, reduction=0.5, decision=decision)
    run_pruning(toy, PROBE_BATCHES, dataclasses.replace(cfg, pool=0.5), probe_loss)
    # pool = w0, w1, w2; G1/G0 = [1.5, 0.25, 0.25]: w0 is vetoed (veto) or ranked last (rank)
    assert pruned(toy) == {(0, 1), (0, 2)}


def test_saliency_picks_the_pair_whose_removal_costs_least() -> None:
    """The probe as a Hessian-vector product. Summed gradients: g0 = [-1, 2, 2, 0] (dense), and
    with the pool w0..w2 halved g1 = [-1.5, -0.5, -0.5, 0]. Predicted loss increase per weight,
    -g0 w + w (g0 - g1) / (2 (1 - r)) with r = 0.5: [1.5, 1, 1.5, -]; prune w1, then w0 (tie, lower
    index). The true loss (2.5 dense): without w0, w1 it is 2.0; without w1, w2 (what the rank
    and veto decisions choose) 5.0; without w0, w2 2.5."""
    toy = Toy(PROBE_W)
    cfg = PruneConfig(method="gradprobe", base="magnitude", sparsity=0.5, reduction=0.5, decision="saliency")
    run_pruning(toy, PROBE_BATCHES, dataclasses.replace(cfg, pool=0.5), probe_loss)
    assert pruned(toy) == {(0, 0), (0, 1)}

    def loss(w: list[float]) -> float:
        return sum(0.5 * (sum(a * b for a, b in zip(w, x[0].tolist())) - float(t)) ** 2 for x, t in PROBE_BATCHES)

    assert loss([0, 0, 3, 4]) < loss([0, 2, 0, 4]) < loss([1, 0, 0, 4])


def test_owl_prunes_the_block_with_more_outliers_less() -> None:
    """Two blocks: OWL gives them target -+ lambda; the one whose Wanda scores have more
    outliers (above 5x the block mean; recomputed here from captured inputs) is pruned less."""
    model = build_model("tiny-llama")
    inputs: dict[str, list[torch.Tensor]] = {}
    names = {m: n for n, m in model.named_modules()}

    def capture(mod: nn.Module, a: tuple) -> None:
        inputs.setdefault(names[mod], []).append(a[0].detach().reshape(-1, a[0].shape[-1]))

    hooks = [lin.register_forward_pre_hook(capture) for lin in target_linears(model)]
    with torch.no_grad():
        for batch in calib():
            model(input_ids=batch)
    for h in hooks:
        h.remove()
    ratio = []
    for block in decoder_blocks(model):
        scores = [
            (lin.weight.abs() * torch.cat(inputs[names[lin]]).double().norm(dim=0).float()).flatten()
            for lin in block.modules()
            if isinstance(lin, nn.Linear)
        ]
        flat = torch.cat(scores)
        ratio.append(float((flat > 5 * flat.mean()).float().mean()))
    assert ratio[0] != ratio[1]
    sparsity = [0.42, 0.58] if ratio[0] > ratio[1] else [0.58, 0.42]
    report = run_pruning(model, calib(), PruneConfig(method="wanda", sparsity=0.5, allocation="owl", owl_lambda=0.08), lm_loss)
    for layer in report.layers:
        block = 0 if ".layers.0." in f".{layer.name}." else 1
        rows, cols = next(m.weight.shape for n, m in model.named_modules() if n == layer.name)
        assert layer.pruned == rows * count_for(sparsity[block], cols), layer.name
    # OWL's own pass over the dense model, then Wanda's block by block: the capture up to the last of the
    # two blocks (1/2 of a pass), then each block dense and pruned (2 x 1/2 each)
    assert report.fwd_passes == 1 + 0.5 + 2


def test_every_config_method_has_one_registry_entry_with_its_facts() -> None:
    """The config's vocabulary, the facts table and the pipeline's registry name the same
    methods (a name in one and not the others would be refused late or silently ignored); no
    I/O, milliseconds."""
    named = set(PRUNE_METHODS) - {"none"}
    assert set(PRUNE_METHOD_FACTS) == named == set(REGISTRY)
    for name, method in REGISTRY.items():
        assert method.facts is PRUNE_METHOD_FACTS[name]
        assert method_of(PruneConfig(method=name)) is method
    with pytest.raises(ValueError, match="names no pruning method"):
        method_of(PruneConfig(method="none"))
