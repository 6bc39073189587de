"""python -m pretrain.analysis: the EqCo toy MI experiment reproduces EqCo's K-independence, the
NPC multiplier matches a per-anchor brute force, curves and negatives write what they promise."""

from __future__ import annotations

import csv
import json
import math
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

from pretrain.analysis import curves, negatives, npc
from pretrain.analysis.__main__ import main
from pretrain.analysis.common import AnalysisError
from pretrain.analysis.mi_toy import (
    QUICK,
    StackedCritics,
    ToyConfig,
    batch_losses,
    correlation,
    gaussian_mi,
    sample_pairs,
)
from pretrain.augment import build_view_transforms
from pretrain.data import ImageDataset
from pretrain.methods import METHODS

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _csv(path: Path) -> list[dict]:
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def _is_png(path: Path) -> bool:
    return path.is_file() and path.read_bytes()[:8] == PNG_MAGIC and path.stat().st_size > 5000


# ------------------------------------------------------------------------------------ mi-toy
def test_mi_toy_quick_eqco_varies_less_across_k_than_infonce(tmp_path, capsys):
    main(["mi-toy", "--quick", "--out", str(tmp_path), "--device", "cpu"])
    printed = capsys.readouterr().out
    assert "InfoNCE" in printed and "EqCo" in printed and "(paper's Table 9 values in parentheses)" in printed
    rows = _csv(tmp_path / "mi_toy.csv")
    assert len(rows) == len(QUICK["true_mi"]) * len(QUICK["ks"]) * 2
    est = {(float(r["true_mi"]), int(r["k"]), r["loss"]): float(r["estimate"]) for r in rows}
    for (_mi, k, loss), value in est.items():
        if loss == "infonce":  # Oord et al.: log K − L ≤ log K (K − 1 negatives per query)
            assert value <= math.log(k) + 1e-9

    # The spread across K, recomputed from the CSV: EqCo's is far below InfoNCE's.
    def spread(loss):
        stds = [
            torch.tensor([est[(mi, k, loss)] for k in QUICK["ks"]]).std(unbiased=False).item()
            for mi in QUICK["true_mi"]
        ]
        return sum(stds) / len(stds)

    assert spread("eqco") < 0.5 * spread("infonce"), (spread("eqco"), spread("infonce"))
    summary = json.loads((tmp_path / "mi_toy.json").read_text())
    assert summary["spread_across_k"]["eqco"] == pytest.approx(spread("eqco"), abs=1e-6)
    # At the largest true MI InfoNCE is held under log K while EqCo (ceiling log 513) is not.
    top = max(QUICK["true_mi"])
    assert all(est[(top, k, "eqco")] > est[(top, k, "infonce")] + 0.5 for k in QUICK["ks"])
    assert _is_png(tmp_path / "mi_toy.png")


def test_mi_toy_losses_match_a_per_anchor_loop():
    cfg = ToyConfig(dim=3, hidden=8, embed_dim=4, device="cpu")
    critics = StackedCritics(2, cfg, generator_seed=1)
    g = torch.Generator().manual_seed(0)
    x, y = sample_pairs(torch.tensor([0.5, 0.9]), 5, 3, g)
    margins = torch.tensor([0.0, math.log(512 / 4)])  # InfoNCE, EqCo with α = 512 and K − 1 = 4 negatives
    got = batch_losses(critics, x, y, margins)

    def mlp(params, m, v):  # critic m by hand from the stacked weights
        h = torch.relu(v @ params["0.weight"][m].T + params["0.bias"][m])
        return h @ params["2.weight"][m].T + params["2.bias"][m]

    for m in range(2):
        with torch.no_grad():
            fx, fy = mlp(critics.g, m, x[m]).double(), mlp(critics.h, m, y[m]).double()
        losses = []
        for i in range(5):
            s = [float(fx[i] @ fy[j]) for j in range(5)]
            pos = math.exp(s[i] - float(margins[m]))
            losses.append(-math.log(pos / (pos + sum(math.exp(s[j]) for j in range(5) if j != i))))
        assert got[m].item() == pytest.approx(sum(losses) / 5, rel=1e-5)


def test_correlated_gaussians_have_the_requested_mutual_information():
    for mi in (2.0, 10.0):
        rho = correlation(mi, 20)
        assert gaussian_mi(rho, 20) == pytest.approx(mi)
        x, y = sample_pairs(torch.tensor([rho]), 20000, 20, torch.Generator().manual_seed(0))
        empirical = ((x[0] * y[0]).mean(0) / (x[0].std(0) * y[0].std(0))).mean().item()
        assert empirical == pytest.approx(rho, abs=0.01)


# ------------------------------------------------------------------------------------ curves
def test_curves_merge_steps_and_write_columns(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    lines = [
        {
            "step": 1,
            "epoch": 0.5,
            "lr": 0.1,
            "data_time": 0.01,
            "step_time": 0.2,
            "loss": 5.0,
            "mi_bound": 0.5,
            "npc_mean": 0.9,
            "npc_cv": 0.1,
            "pos_cos": 0.5,
            "neg_cos": 0.0,
        },
        {
            "step": 2,
            "epoch": 1.0,
            "lr": 0.1,
            "data_time": 0.01,
            "step_time": 0.2,
            "loss": 4.0,
            "mi_bound": 1.5,
            "npc_mean": 0.8,
            "npc_cv": 0.2,
            "pos_cos": 0.6,
            "neg_cos": 0.0,
            "grad_q_norm_mean": 0.3,
            "grad_q_norm_std": 0.05,
        },
        {"step": 2, "epoch": 1.0, "knn_top1": 12.5},
        {
            "step": 3,
            "epoch": 1.5,
            "lr": 0.05,
            "data_time": 0.01,
            "step_time": 0.2,
            "loss": 9.0,
            "mi_bound": 0.1,
            "npc_mean": 0.8,
            "npc_cv": 0.2,
            "pos_cos": 0.6,
            "neg_cos": 0.0,
        },
        # a resumed run re-logs step 3: the later line wins
        {
            "step": 3,
            "epoch": 1.5,
            "lr": 0.05,
            "data_time": 0.01,
            "step_time": 0.2,
            "loss": 3.0,
            "mi_bound": 2.0,
            "npc_mean": 0.8,
            "npc_cv": 0.2,
            "pos_cos": 0.6,
            "neg_cos": 0.0,
            "bank_filled": 1.0,
        },
    ]
    (run / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in lines) + "\n")
    main(["curves", str(run)])
    out = run / "analysis"
    with open(out / "curves.csv", newline="") as f:
        header = next(csv.reader(f))
    assert header == [
        "step",
        "epoch",
        "lr",
        "loss",
        "mi_bound",
        "npc_mean",
        "npc_cv",
        "pos_cos",
        "neg_cos",
        "grad_q_norm_mean",
        "grad_q_norm_std",
        "knn_top1",
        "data_time",
        "step_time",
        "bank_filled",
    ]
    rows = _csv(out / "curves.csv")
    assert [r["step"] for r in rows] == ["1", "2", "3"]
    assert (rows[1]["knn_top1"], rows[1]["loss"], rows[2]["loss"], rows[0]["knn_top1"]) == ("12.5", "4.0", "3.0", "")
    assert _is_png(out / "curves.png")


def test_curves_bad_line_names_file_and_line(tmp_path):
    (tmp_path / "metrics.jsonl").write_text('{"step": 1, "loss": 1.0}\n{"step": 2, "loss": \n')
    with pytest.raises(AnalysisError, match=r"metrics.jsonl line 2: not JSON"):
        curves.run(tmp_path)
    with pytest.raises(SystemExit, match="does not exist"):
        main(["curves", str(tmp_path / "missing")])


def test_npc_matches_a_per_anchor_brute_force(tiny_moco, synthetic_root, tmp_path):
    root = synthetic_root / "imagenet" / "train"
    summary = npc.run(
        tiny_moco / "checkpoint_last.pth", tmp_path, data=str(root), batch_sizes=(4, 5, 10**6), max_images=14, seed=3
    )
    assert summary["embedding"].startswith("projection") and summary["skipped_batch_sizes"] == [10**6]
    values = _csv(tmp_path / "npc_values.csv")
    # ⌊14/4⌋ = 3 batches of 4 and 2 of 5, two anchors (views) per image
    assert (
        sum(r["batch_size"] == "4" for r in values) == 2 * 12 and sum(r["batch_size"] == "5" for r in values) == 2 * 10
    )

    # Independent rebuild of the embedding: the MoCo query encoder (eval BN) of checkpoint_last.
    state = torch.load(tiny_moco / "checkpoint_last.pth", map_location="cpu", weights_only=False)
    cfg = OmegaConf.create(state["config"])
    method = METHODS["moco"](cfg, 1)
    method.load_state_dict(state["method_state"])
    encoder = method.encoder_q.eval()
    dataset = ImageDataset(
        root, build_view_transforms(cfg.data.augmentation, cfg.data.image_size), seed=3, backend="torchvision"
    )
    tau = cfg.method.temperature
    batches: dict[tuple[str, str], list[dict]] = {}
    for r in values:
        batches.setdefault((r["batch_size"], r["batch"]), []).append(r)
    views: dict[int, torch.Tensor] = {}  # image index -> its two embedded views (augmentation seeded per image)
    for rows in batches.values():
        images = list(dict.fromkeys(int(r["image"]) for r in rows))
        for i in images:
            if i not in views:
                with torch.no_grad():
                    views[i] = torch.nn.functional.normalize(encoder(torch.stack(dataset[i][0])).double(), dim=1)
        z = [views[i] for i in images]
        for r in rows:
            a, view = images.index(int(r["image"])), int(r["view"]) - 1
            anchor, positive = z[a][view], z[a][1 - view]
            negatives = [z[j][v] for j in range(len(images)) if j != a for v in (0, 1)]
            e_pos = math.exp(float(anchor @ positive) / tau)
            expected = 1 - e_pos / (e_pos + sum(math.exp(float(anchor @ n) / tau) for n in negatives))
            assert float(r["q"]) == pytest.approx(expected, abs=1e-5)
    stats = {int(r["batch_size"]): r for r in _csv(tmp_path / "npc.csv")}
    q4 = torch.tensor([float(r["q"]) for r in values if r["batch_size"] == "4"], dtype=torch.float64)
    assert float(stats[4]["mean"]) == pytest.approx(q4.mean().item())
    assert float(stats[4]["cv"]) == pytest.approx((q4.std(unbiased=False) / q4.mean()).item())
    assert _is_png(tmp_path / "npc.png")


def test_npc_on_a_final_export_uses_backbone_features(tiny_moco, synthetic_root, tmp_path):
    data = str(synthetic_root / "imagenet" / "train")
    final = str(tiny_moco / "checkpoint_final.pth")
    main(["npc", final, "--out", str(tmp_path), "--data", data, "--batch-sizes", "4", "--max-images", "8"])
    summary = json.loads((tmp_path / "npc.json").read_text())
    assert summary["embedding"].startswith("backbone") and summary["temperature"] == 0.2
    assert 0.0 <= summary["stats"][0]["p05"] <= summary["stats"][0]["p95"] <= 1.0


def test_npc_reads_tar_shards_of_the_folder_with_the_folders_figures(tiny_moco, synthetic_root, tmp_path):
    from transfer import shards

    folder = synthetic_root / "imagenet" / "train"
    shards.main([str(folder), str(tmp_path / "shards"), "--shard-size", "100"])
    final = str(tiny_moco / "checkpoint_final.pth")
    summaries = []
    for name, data in [("folder", str(folder)), ("shards", str(tmp_path / "shards" / "train-{000000..000003}.tar"))]:
        main(["npc", final, "--out", str(tmp_path / name), "--data", data, "--batch-sizes", "4", "--max-images", "8"])
        summaries.append(json.loads((tmp_path / name / "npc.json").read_text()))
    assert summaries[0]["stats"] == summaries[1]["stats"] and summaries[0]["stats"][0]["mean"] > 0


# ------------------------------------------------------------------------------------ negatives
def test_negatives_of_a_tiny_moco_run(tiny_moco, synthetic_root, tmp_path):
    main(
        [
            "negatives",
            str(tiny_moco),
            "--queries",
            "20",
            "--out",
            str(tmp_path),
            "--data",
            str(synthetic_root / "imagenet" / "train"),
        ]
    )
    rows = _csv(tmp_path / "negatives.csv")
    queue = torch.load(tiny_moco / "checkpoint_last.pth", map_location="cpu", weights_only=False)["method_state"][
        "queue"
    ]
    assert sum(r["kind"] == "negative" for r in rows) == queue.shape[1] == 64
    # whole minibatches of train.batch_size = 8 only: 20 → 16 queries in two minibatches
    assert sorted({r["batch"] for r in rows if r["kind"] == "query"}) == ["0", "1"]
    summary = json.loads((tmp_path / "negatives.json").read_text())
    assert (summary["negatives_key"], summary["num_queries"], summary["step"]) == ("queue", 16, 2)
    near = summary["negative_to_nearest_query_cos"]
    assert -1.0 <= near["p05"] <= near["p50"] <= near["p95"] <= 1.0
    assert _is_png(tmp_path / "negatives.png")


def test_negative_banks_are_read_as_unit_rows():
    d, k = 4, 6
    queue = torch.nn.functional.normalize(torch.randn(d, k), dim=0)
    key, got = negatives.find_negatives({"queue": queue, "queue_ptr": torch.tensor(0)}, Path("x.pth"))
    assert key == "queue" and torch.allclose(got, queue.T)
    raw = torch.randn(d, k) * 7  # AdCo keeps W raw; the loss uses W_k / ‖W_k‖
    key, got = negatives.find_negatives(
        {"bank.weight": raw, "bank.momentum_buffer": raw, "filled": torch.tensor(6)}, Path("x.pth")
    )
    assert key == "bank.weight" and torch.allclose(got, (raw / raw.norm(dim=0)).T)
    with pytest.raises(AnalysisError, match=r"x.pth: no stored negatives .*'queue', 'bank.weight'"):
        negatives.find_negatives({"encoder.weight": raw}, Path("x.pth"))


def test_a_plain_pickle_named_pth_is_one_line_as_torch_phrases_it(tmp_path):
    """torch.load says "Invalid magic number" for a plain pickle (not torch.save's format); the
    dry run of the legacy reader checks the same headers, so the analyses say it too (before,
    the dry run ended in an EOFError with no message, and the analysis in an IndexError)."""
    import pickle

    from pretrain.analysis.common import load_checkpoint

    path = tmp_path / "plain.pth"
    path.write_bytes(pickle.dumps({"method": {}}, protocol=2))
    with pytest.raises(RuntimeError, match="Invalid magic number"):
        torch.load(path, weights_only=True)  # the judge
    with pytest.raises(AnalysisError, match=f"cannot read checkpoint {path}: Invalid magic number; corrupt file"):
        load_checkpoint(path)


def test_a_summary_writes_an_undefined_estimate_as_null_in_standard_json(tmp_path):
    """The judge is a strict JSON reader (Python's, refusing the NaN/Infinity tokens that
    ``json.dumps`` writes by default); the control shows plain ``json.dumps`` fails it."""
    from pretrain.analysis.common import write_summary

    def strict(text: str):
        def refuse(token):
            raise ValueError(f"not standard JSON: {token}")

        return json.loads(text, parse_constant=refuse)

    summary = {"mi": float("nan"), "bounds": [1.5, float("inf")], "per_k": {"16": -float("inf"), "64": 2.0}}
    with pytest.raises(ValueError, match="not standard JSON"):
        strict(json.dumps(summary))  # the control: what the analysis wrote before
    path = write_summary(tmp_path / "s.json", summary)
    assert strict(path.read_text()) == {"mi": None, "bounds": [1.5, None], "per_k": {"16": None, "64": 2.0}}
