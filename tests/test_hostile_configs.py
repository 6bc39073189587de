"""Hostile configs, URLs and dataset lists, generated (issue 38): a seeded generator makes mutants of
valid inputs (a pretraining recipe, a detection config, COCO json, VOC XML, a Places205 list) and
runs each through the entry point that reads it. Every mutant must end in one line (a UserError)
naming the file and the key, never a traceback; no secret may reach a message or a file; nothing may
be written outside the run's folder; no request may reach a local HTTP server unless the command
line opts in. Each attack has a control showing it live without the defence. The larger sweep is
marked slow; the fast one draws a few mutants of each kind (HOSTILE_SEED picks another draw)."""

from __future__ import annotations

import copy
import http.server
import json
import math
import os
import pickle
import random
import shutil
import subprocess
import sys
import threading
from functools import partial
from pathlib import Path

import numpy as np
import pytest
import yaml
from omegaconf import OmegaConf

from contrastive_transfer.cli import UserError

REPO = Path(__file__).resolve().parents[1]
RECIPE = REPO / "configs" / "pretrain" / "tiny_simclr.yaml"
TINY_VOC = REPO / "configs" / "detection" / "tiny_voc0712_R_18_FPN_syncbn.yaml"
SEED = int(os.environ.get("HOSTILE_SEED", "38"))
SECRET = "s3cr3t-7f1c"

# values of every kind; a mutant puts one of another kind than the valid value where it was
KINDS = {
    "bool": [True, False],
    "int": [0, 7, -3, 10**30],
    "float": [0.5, -2.5, 1e300],
    "str": ["text", "", "../../x"],
    "list": [[], [1, "a"], [[1]]],
    "dict": [{}, {"a": 1}, {"b": {"c": None}}],
}


def _kind(value) -> str:
    if isinstance(value, bool):
        return "bool"
    return {int: "int", float: "float", str: "str", list: "list", dict: "dict"}.get(type(value), "null")


def one_line(error: BaseException, *names: object) -> str:
    """The refusal is a UserError of one line naming every one of ``names``, with no secret."""
    assert isinstance(error, UserError), f"{type(error).__name__}: {error}"
    text = str(error)
    assert "\n" not in text and SECRET not in text, text
    for name in names:
        assert str(name) in text, (name, text)
    return text


def refusal(call, *names: object) -> str:
    with pytest.raises(Exception) as e:
        call()
    return one_line(e.value, *names)


def tree_of(root: Path) -> set[str]:
    return {str(p.relative_to(root)) for p in root.rglob("*")}


@pytest.fixture
def secret_env(monkeypatch):
    monkeypatch.setenv("SECRET_TOKEN", SECRET)


# ------------------------------------------------------------------------------------- recipes


def _leaves(node, prefix=()):
    """(path, value) of every key of a plain config, sections included (outermost first)."""
    if isinstance(node, dict):
        for k, v in node.items():
            yield (*prefix, k), v
            yield from _leaves(v, (*prefix, k))


@pytest.fixture(scope="module")
def valid_recipe():
    from pretrain.config import load_config

    cfg = OmegaConf.to_container(load_config(RECIPE))
    cfg["data"]["views"] = None  # the preset's expanded views are the loader's output, not its input
    return cfg


def _write_recipe(directory: Path, body: dict, base: Path | str | None = RECIPE, name: str = "mutant.yaml") -> Path:
    path = directory / name
    data = ({"_base_": str(base)} if base is not None else {}) | body
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def _nested(path: tuple, value) -> dict:
    out = value
    for part in reversed(path):
        out = {part: out}
    return out


def wrong_type_mutants(valid: dict, rng: random.Random, per_key: int):
    """(key path, wrong value) for keys at every level: a value of another kind than the valid one."""
    for path, value in _leaves(valid):
        if path[-1] == "views" or value is None:  # views take list or dict edits; null keys take any one kind
            continue
        kind = _kind(value)
        others = [k for k in KINDS if k != kind and not (kind == "float" and k == "int")]
        for k in rng.sample(others, min(per_key, len(others))):
            yield path, rng.choice(KINDS[k])


def _check_wrong_types(valid_recipe, tmp_path, per_key: int, seed: int) -> int:
    from pretrain.config import load_config

    count = 0
    for path, value in wrong_type_mutants(valid_recipe, random.Random(seed), per_key):
        recipe = _write_recipe(tmp_path, _nested(path, value))
        text = refusal(partial(load_config, recipe), recipe)
        # the key is named: its dotted path, or the innermost section that the value replaced
        assert ".".join(map(str, path)) in text or repr(value)[:20] in text, (path, value, text)
        count += 1
    return count


def test_a_wrong_type_at_any_level_of_a_recipe_is_one_line(valid_recipe, tmp_path):
    # control: the kinds a mutant uses are live, e.g. a string lr reaches the schedule as text
    assert OmegaConf.merge(OmegaConf.create(valid_recipe), {"optim": {"lr": "text"}}).optim.lr == "text"
    assert _check_wrong_types(valid_recipe, tmp_path, per_key=1, seed=SEED) > 50


@pytest.mark.sweep  # every key and kind; `make test` runs the seeded sample above
def test_every_wrong_type_at_every_level_of_a_recipe_is_one_line(valid_recipe, tmp_path):
    assert _check_wrong_types(valid_recipe, tmp_path, per_key=len(KINDS), seed=SEED + 1) > 250


@pytest.mark.parametrize(
    "body, key",
    [
        ({"_base_": 5}, "_base_"),
        ({"_base_": [str(RECIPE), 3]}, "_base_"),
        ({"_base_": {"a": 1}}, "_base_"),
        ({"_base_": ""}, "_base_"),
        ({"data": {"root": "${no.such.key}"}}, "data.root"),
        ({"data": {"root": "${"}}, "data.root"),
    ],
)
def test_bases_and_interpolations_of_the_wrong_shape_are_one_line(body, key, tmp_path):
    from pretrain.config import load_config

    recipe = tmp_path / "mutant.yaml"
    recipe.write_text(yaml.safe_dump({"_base_": str(RECIPE)} | body))
    refusal(partial(load_config, recipe), recipe, key)


@pytest.mark.parametrize("text", ["- a\n- b\n", "just text\n", "7\n"])
def test_a_recipe_whose_top_level_is_not_a_mapping_is_one_line(text, tmp_path):
    from pretrain.config import load_config

    recipe = tmp_path / "mutant.yaml"
    recipe.write_text(text)
    refusal(partial(load_config, recipe), recipe, "top level")


def resolver_mutants(rng: random.Random, n: int):
    """(recipe body, overrides): a resolver reached by name, through keys, concatenation, escapes,
    nested interpolations, list items and the command line."""
    carriers = ["knn.train_dir", "knn.val_dir", "data.root", "train.resume"]
    spellings = [
        lambda c: ({c: "oc.env"}, "${${%s}:SECRET_TOKEN}" % c),
        lambda c: ({c: "oc"}, "${${%s}.env:SECRET_TOKEN}" % c),
        lambda c: ({}, "${oc.env:SECRET_TOKEN}"),
        lambda c: ({}, "${ oc.env : SECRET_TOKEN }"),
        lambda c: ({}, "prefix-${oc.env:SECRET_TOKEN,default}-suffix"),
        lambda c: ({}, "\\${oc.env:SECRET_TOKEN}"),  # escaped: a live interpolation once resolved
        lambda c: ({}, "${oc.decode:'${oc.env:SECRET_TOKEN}'}"),
        lambda c: ({c: "\\${oc.env:SECRET_TOKEN}"}, "${%s}" % c),
    ]
    for _ in range(n):
        carrier, target = rng.sample(carriers, 2)
        extra, value = rng.choice(spellings)(carrier)
        body: dict = {}
        for key, v in {**extra, target: value}.items():
            body = OmegaConf.to_container(OmegaConf.merge(body, _nested(tuple(key.split(".")), v)))
        if rng.random() < 0.3:  # the same through the command line
            yield {}, [f"{k}={v}" for k, v in {**extra, target: value}.items()], {target, *extra}
        else:
            yield body, [], {target, *extra}


def _control_resolver(body: dict) -> bool:
    """Plain OmegaConf (as a loader without the check would use it) reads the environment."""
    cfg = OmegaConf.create(body)
    try:
        OmegaConf.resolve(cfg)
        return SECRET in json.dumps(OmegaConf.to_container(cfg, resolve=True))
    except Exception:
        return False


def _check_resolvers(tmp_path: Path, n: int, seed: int) -> None:
    from pretrain.config import load_config

    live = 0
    for i, (body, overrides, keys) in enumerate(resolver_mutants(random.Random(seed), n)):
        recipe = _write_recipe(tmp_path, body, name=f"r{i}.yaml")
        text = refusal(partial(load_config, recipe, overrides), recipe)
        assert any(key in text for key in keys), (keys, text)
        if body:
            live += _control_resolver(body)
    assert live > 0  # the control: some of these read the environment under plain OmegaConf


def test_resolvers_are_off_whatever_their_name_is_built_from(tmp_path, secret_env):
    _check_resolvers(tmp_path, 24, SEED)
    # the two reported: a name built from a key, and an escape that resolves into a call
    assert _control_resolver({"n": "oc.env", "a": "${${n}:SECRET_TOKEN}"})
    assert _control_resolver({"a": "\\${oc.env:SECRET_TOKEN}", "b": "${a}"})


@pytest.mark.slow
def test_resolvers_are_off_whatever_their_name_is_built_from_sweep(tmp_path, secret_env):
    _check_resolvers(tmp_path, 300, SEED + 2)


def path_mutants(rng: random.Random, n: int):
    """train.output_dir (or the name in it) reaching outside through an interpolation."""
    outside = ["/tmp/hostile-run", "../../hostile-run", "~/hostile-run", "outputs/../../hostile-run"]
    carriers = ["knn.train_dir", "knn.val_dir", "data.root"]
    for _ in range(n):
        carrier, where = rng.choice(carriers), rng.choice(outside)
        if rng.random() < 0.5:
            body = _nested(tuple(carrier.split(".")), where) | {"train": {"output_dir": "${%s}/run" % carrier}}
            yield OmegaConf.to_container(OmegaConf.merge(body, _nested(tuple(carrier.split(".")), where))), "output_dir"
        else:
            yield _nested(tuple(carrier.split(".")), where) | {"name": "${%s}" % carrier}, "name"


def test_paths_are_checked_after_interpolation_and_nothing_is_written(tmp_path, monkeypatch):
    from pretrain.__main__ import main

    monkeypatch.chdir(tmp_path)
    for i, (body, key) in enumerate(path_mutants(random.Random(SEED), 12)):
        recipe = _write_recipe(tmp_path, body, name=f"p{i}.yaml")
        # control: the text before interpolation is a plain relative path or a plain name
        assert (
            "/" not in str(body.get("name", "x")) and str(body.get("train", {}).get("output_dir", "x"))[0] not in "/~."
        )
        before = tree_of(tmp_path)
        with pytest.raises(SystemExit) as e:
            main(["--config", str(recipe), "--print-config"])
        assert isinstance(e.value.code, str) and "\n" not in e.value.code.strip(), e.value.code
        assert str(recipe) in e.value.code and key in e.value.code, e.value.code
        assert tree_of(tmp_path) == before
    assert not Path("/tmp/hostile-run").exists()


def test_the_command_line_may_still_name_an_output_outside(tmp_path):
    from pretrain.config import load_config

    cfg = load_config(RECIPE, [f"train.output_dir={tmp_path}/${{name}}"])
    assert cfg.train.output_dir == f"{tmp_path}/tiny_simclr"


def alias_bomb(rng: random.Random) -> tuple[str, int]:
    """YAML whose aliases expand to more than the byte cap, and the bytes they expand to."""
    from contrastive_transfer.yaml_limits import MAX_YAML_BYTES

    size = rng.choice([2**12, 2**13, 2**14])  # small strings, many aliases: PyYAML scans text slowly
    copies = MAX_YAML_BYTES // size + rng.randint(1, 50)
    nest = rng.random() < 0.5
    if nest:  # aliases of a list of aliases
        inner = copies // 10 + 1
        text = f'a: &a "{"x" * size}"\nb: &b [{", ".join(["*a"] * 10)}]\nc: [{", ".join(["*b"] * inner)}]\n'
        return text, size * 10 * inner
    return f'a: &a "{"x" * size}"\nc: [{", ".join(["*a"] * copies)}]\n', size * copies


def test_alias_bombs_count_bytes_not_only_values(tmp_path):
    from contrastive_transfer.yaml_limits import MAX_YAML_BYTES, MAX_YAML_NODES
    from pretrain.config import load_config

    rng = random.Random(SEED)
    for i in range(4):
        text, expanded = alias_bomb(rng)
        assert expanded > MAX_YAML_BYTES and text.count("*") < MAX_YAML_NODES  # a value count would pass it
        recipe = tmp_path / f"bomb{i}.yaml"
        recipe.write_text(f"_base_: {RECIPE}\nmethod:\n  x:\n" + "".join(f"    {ln}\n" for ln in text.splitlines()))
        refusal(partial(load_config, recipe), recipe, "anchors and aliases")
    # control (at the smallest scale above the cap): plain OmegaConf builds and writes it all out
    text = f'a: &a "{"x" * 2**14}"\nc: [{", ".join(["*a"] * (MAX_YAML_BYTES // 2**14 + 1))}]\n'
    assert len(OmegaConf.to_yaml(OmegaConf.create(text))) > MAX_YAML_BYTES


def base_graph(directory: Path, rng: random.Random, base_key: str, last: str) -> tuple[Path, str | None]:
    """A chain of configs, the last holding ``last`` (no base of its own) unless the chain loops back;
    returns its first file and what must be refused ('loops', 'deeper than', or None: it loads)."""
    from contrastive_transfer.yaml_limits import MAX_BASE_DEPTH

    length = rng.randint(2, MAX_BASE_DEPTH + 3)
    loop_to = rng.randrange(length) if rng.random() < 0.5 else None
    files = [directory / f"c{i}.yaml" for i in range(length)]
    for i, f in enumerate(files):
        nxt = files[i + 1].name if i + 1 < length else (files[loop_to].name if loop_to is not None else None)
        f.write_text(f"{base_key}: {nxt}\n" if nxt is not None else last)
    if length > MAX_BASE_DEPTH:  # the chain reaches the depth limit before it could close a loop
        return files[0], "deeper than"
    return files[0], "loops" if loop_to is not None else None


def test_base_chains_loop_and_depth_are_one_line(valid_recipe, tmp_path):
    from pretrain.config import load_config

    rng = random.Random(SEED)
    flat_recipe = {k: v for k, v in valid_recipe.items() if k != "data"} | {
        "data": {k: v for k, v in valid_recipe["data"].items() if k != "views"}
    }
    outcomes = set()
    for i in range(10):
        directory = tmp_path / f"g{i}"
        directory.mkdir()
        first, expected = base_graph(directory, rng, "_base_", yaml.safe_dump(flat_recipe))
        if expected is None:
            assert load_config(first).method.name == "simclr"
        else:
            refusal(partial(load_config, first), "_base_ chain", expected)
        outcomes.add(expected)
    assert outcomes >= {"loops", None}


def test_a_base_listed_twice_at_every_level_reads_a_bounded_number_of_files(tmp_path):
    from pretrain.config import load_config

    for i in range(4):  # 3^4 reads of the last without a cap on files
        (tmp_path / f"d{i}.yaml").write_text(f"_base_: [d{i + 1}.yaml, d{i + 1}.yaml, d{i + 1}.yaml]\n")
    (tmp_path / "d4.yaml").write_text(f"_base_: {RECIPE}\n")
    refusal(partial(load_config, tmp_path / "d0.yaml"), "more than")


# ------------------------------------------------------------------------------------- network


class _Server:
    """A local HTTP server that records every request."""

    def __init__(self, directory: Path):
        self.requests: list[str] = []
        requests = self.requests

        class Handler(http.server.SimpleHTTPRequestHandler):
            def __init__(self, *a, **k):
                super().__init__(*a, directory=str(directory), **k)

            def log_message(self, *args):
                requests.append(self.path)

        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_port}"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def close(self):
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def server(tmp_path, monkeypatch):
    monkeypatch.setenv("no_proxy", "127.0.0.1")
    monkeypatch.setenv("NO_PROXY", "127.0.0.1")
    monkeypatch.setenv("FVCORE_CACHE", str(tmp_path / "iopath_cache"))  # the controls' downloads stay here
    served = tmp_path / "served"
    served.mkdir()
    s = _Server(served)
    s.dir = served
    yield s
    s.close()


@pytest.fixture(scope="module")
def detection():
    pytest.importorskip("detectron2")
    from transfer.detection.__main__ import main
    from transfer.detection.config import build_config

    return build_config, main


def _nan_pkl(path: Path) -> Path:
    model = {"backbone.bottom_up.stem.conv1.weight": np.full((4, 3, 3, 3), np.nan, np.float32)}
    path.write_bytes(pickle.dumps({"model": model, "__author__": "hostile", "matching_heuristics": True}))
    return path


def url_mutants(url: str, rng: random.Random, n: int):
    """(config body, opts): a URL where a _BASE_ or MODEL.WEIGHTS is read."""
    names = [f"{url}/base.yaml", f"{url.upper().replace('HTTP', 'http')}/base.yaml", f"{url}/nan.pkl"]
    for _ in range(n):
        where = rng.choice(["base", "base_list", "weights_file", "weights_override", "base_of_base"])
        name = rng.choice(names)
        if where == "base":
            yield f"_BASE_: {name}\n", []
        elif where == "base_list":
            yield f"_BASE_: [{TINY_VOC}, {name}]\n", []
        elif where == "weights_file":
            yield f"_BASE_: {TINY_VOC}\nMODEL:\n  WEIGHTS: {name}\n", []
        elif where == "weights_override":
            yield f"_BASE_: {TINY_VOC}\n", ["MODEL.WEIGHTS", name]
        else:
            yield f"_BASE_: [{TINY_VOC}, inner.yaml]\n", [], f"_BASE_: {name}\n"


def test_no_url_is_fetched_without_the_flag(detection, server, tmp_path):
    from detectron2.config import get_cfg
    from detectron2.utils.file_io import PathManager

    build_config, _ = detection
    (server.dir / "base.yaml").write_text("SEED: 5\n")
    _nan_pkl(server.dir / "nan.pkl")
    work = tmp_path / "work"
    work.mkdir()
    for i, (body, opts, *inner) in enumerate(url_mutants(server.url, random.Random(SEED), 10)):
        if inner:
            (work / "inner.yaml").write_text(inner[0])
        config = work / f"d{i}.yaml"
        config.write_text(body)
        refusal(partial(build_config, str(config), [*opts, "OUTPUT_DIR", str(work / "out")]), "--allow-network")
    assert server.requests == [] and not (work / "out").exists()
    # the model zoo's names are URLs too
    config = work / "zoo.yaml"
    config.write_text(f"_BASE_: {TINY_VOC}\nMODEL:\n  WEIGHTS: detectron2://ImageNetPretrained/MSRA/R-50.pkl\n")
    refusal(partial(build_config, str(config), []), "detectron2://", "--allow-network")
    # control: detectron2's own loading fetches both the _BASE_ and the weights
    plain = work / "plain.yaml"
    plain.write_text(f"_BASE_: {server.url}/base.yaml\n")
    cfg = get_cfg()
    cfg.merge_from_file(str(plain), allow_unsafe=False)
    assert cfg.SEED == 5
    PathManager.get_local_path(f"{server.url}/nan.pkl")
    assert server.requests == ["/base.yaml", "/nan.pkl"]


def test_with_the_flag_fetched_files_get_the_local_checks(detection, server, synthetic_root, tmp_path):
    from contrastive_transfer.yaml_limits import MAX_YAML_BYTES

    build_config, main = detection
    (server.dir / "base.yaml").write_text("SEED: 5\n")
    (server.dir / "bomb.yaml").write_text(
        f'a: &a "{"x" * 2**18}"\nb: [{", ".join(["*a"] * (MAX_YAML_BYTES // 2**18 + 1))}]\n'
    )
    (server.dir / "loop.yaml").write_text("_BASE_: loop.yaml\n")
    _nan_pkl(server.dir / "nan.pkl")
    config = tmp_path / "net.yaml"
    config.write_text(f"_BASE_: [{TINY_VOC}, {server.url}/base.yaml]\n")
    cfg, _ = build_config(str(config), ["OUTPUT_DIR", str(tmp_path / "out")], allow_network=True)
    assert cfg.SEED == 5 and server.requests == ["/base.yaml"]
    for name, expected in [("bomb.yaml", "anchors and aliases"), ("loop.yaml", "loops")]:
        config.write_text(f"_BASE_: {server.url}/{name}\n")
        refusal(partial(build_config, str(config), [], allow_network=True), expected)
    # NaN weights fetched: refused before training, the fetched file inside the run's folder
    out = tmp_path / "run"
    argv = ["--config-file", str(TINY_VOC), "--data-root", str(synthetic_root), "--allow-network"]
    with pytest.raises(SystemExit) as e:
        main([*argv, "OUTPUT_DIR", str(out), "MODEL.WEIGHTS", f"{server.url}/nan.pkl", "SOLVER.MAX_ITER", "1"])
    assert "non-finite" in e.value.code and "\n" not in e.value.code.strip(), e.value.code
    assert [p.parent for p in out.rglob("*.pkl")] == [out / "fetched"]


def test_file_urls_are_local_paths(detection, tmp_path):
    build_config, _ = detection
    config = tmp_path / "local.yaml"
    config.write_text(f"_BASE_: file://{TINY_VOC}\nMODEL:\n  WEIGHTS: file://{tmp_path}/w.pkl\nSEED: 3\n")
    cfg, _ = build_config(f"file://{config}", [])
    assert cfg.SEED == 3 and cfg.MODEL.WEIGHTS == f"{tmp_path}/w.pkl"


def _check_detection_wrong_types(build_config, tmp_path: Path, keys: int | None, seed: int) -> int:
    """Every (or ``keys`` random) key of a valid detection config, at every level, set to a value of
    each other kind: one line naming the key."""
    cfg, _ = build_config(str(TINY_VOC), [])
    leaves = [(p, v) for p, v in _leaves(yaml.safe_load(cfg.dump())) if v is not None]
    rng = random.Random(seed)
    count = 0
    for path, value in rng.sample(leaves, keys) if keys else leaves:
        for kind in [k for k in KINDS if k != _kind(value)]:
            config = tmp_path / "mutant.yaml"
            config.write_text(yaml.safe_dump({"_BASE_": str(TINY_VOC)} | _nested(path, rng.choice(KINDS[kind]))))
            text = refusal(partial(build_config, str(config), []), config)
            assert path[-1] in text or "MODEL.WEIGHTS" in text, (path, text)
            count += 1
    return count


def test_a_wrong_type_at_any_level_of_a_detection_config_is_one_line(detection, tmp_path):
    from detectron2.config import get_cfg

    build_config, _ = detection
    assert _check_detection_wrong_types(build_config, tmp_path, 8, SEED) >= 30
    # control: detectron2 compares VERSION before any type check, a traceback of its own
    config = tmp_path / "version.yaml"
    config.write_text("VERSION: [1]\n")
    with pytest.raises(TypeError):
        get_cfg().merge_from_file(str(config), allow_unsafe=False)


@pytest.mark.sweep  # every key and kind; `make test` runs the seeded sample above
def test_every_wrong_type_at_every_level_of_a_detection_config_is_one_line(detection, tmp_path):
    build_config, _ = detection
    assert _check_detection_wrong_types(build_config, tmp_path, None, SEED) > 1000


def test_detection_base_loops_wrong_types_and_depth_are_one_line(detection, tmp_path):
    from detectron2.config import CfgNode

    build_config, _ = detection
    rng = random.Random(SEED)
    outcomes = set()
    for i in range(8):
        directory = tmp_path / f"g{i}"
        directory.mkdir()
        first, expected = base_graph(directory, rng, "_BASE_", "SEED: 11\n")
        if expected is None:
            assert build_config(str(first), [])[0].SEED == 11
        else:
            refusal(partial(build_config, str(first), []), "_BASE_ chain", expected)
        outcomes.add(expected)
    assert "loops" in outcomes
    (tmp_path / "self.yaml").write_text("_BASE_: self.yaml\n")
    with pytest.raises(RecursionError):  # control: fvcore follows the loop until Python stops it
        CfgNode.load_yaml_with_base(str(tmp_path / "self.yaml"))
    for body in ["_BASE_: 5\n", "_BASE_: [1, 2]\n", "_BASE_: {a: 1}\n", "- a\n", "", "7\n"]:
        config = tmp_path / "shape.yaml"
        config.write_text(body)
        refusal(partial(build_config, str(config), []), config)


def test_the_detection_cli_refuses_a_url_base_in_a_subprocess(server, tmp_path):
    pytest.importorskip("detectron2")
    (server.dir / "base.yaml").write_text("SEED: 5\n")
    config = tmp_path / "remote.yaml"
    config.write_text(f"_BASE_: {server.url}/base.yaml\n")
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "HOME": str(tmp_path)}
    done = subprocess.run(
        [sys.executable, "-m", "transfer.detection", "--config-file", str(config)],
        capture_output=True,
        text=True,
        env=env,
        cwd=tmp_path,
        timeout=120,
    )
    errors = [line for line in done.stderr.splitlines() if line.startswith("error:")]
    assert done.returncode == 1 and len(errors) == 1 and "--allow-network" in errors[0], done.stderr
    assert "Traceback" not in done.stderr and server.requests == []
    assert tree_of(tmp_path) == {"remote.yaml", "served", "served/base.yaml"}


# ------------------------------------------------------------------------------------- datasets


@pytest.fixture
def coco(synthetic_root, tmp_path):
    pytest.importorskip("detectron2")
    from transfer.detection.datasets import register_datasets

    root = tmp_path / "data"
    shutil.copytree(synthetic_root / "coco", root / "coco")
    path = root / "coco" / "annotations" / "instances_val2017.json"
    yield root, path, json.loads(path.read_text())
    register_datasets()


def _coco_refusal(root: Path, path: Path, *names) -> str:
    from transfer.detection.datasets import check_datasets, register_datasets

    register_datasets(root)
    return refusal(partial(check_datasets, ["coco_2017_val"], root, load=True), path, *names)


def _deep(depth: int) -> str:
    return "[" * depth + "]" * depth


COCO_READ = {
    "images": ("id", "file_name", "height", "width"),
    "annotations": ("id", "image_id", "category_id", "bbox", "area", "iscrowd", "segmentation"),
}


def coco_mutants(valid: dict, rng: random.Random, n: int):
    """(json text, words the refusal must hold)."""
    for _ in range(n):
        data = copy.deepcopy(valid)
        kind = rng.choice(["deep", "duplicate", "counts", "field", "number"])
        section = rng.choice(["images", "annotations"])
        entry = rng.choice(data[section])
        if kind == "deep":
            key = rng.choice(list(entry))
            entry[key] = "@DEEP@"
            yield json.dumps(data).replace('"@DEEP@"', _deep(rng.choice([40, 3000, 200_000]))), ["levels deep"]
        elif kind == "duplicate":
            data[section].append(copy.deepcopy(entry))
            yield json.dumps(data), [f"{section}[{len(data[section]) - 1}]", "id"]
        elif kind == "counts":
            ann = rng.choice(data["annotations"])
            ann["segmentation"] = rng.choice([{"size": [10, 10]}, {"counts": 5, "size": [1, 1]}, [5], "x"])
            yield json.dumps(data), ["segmentation"]
        elif kind == "field":  # a field that detectron2 or pycocotools (training, evaluation) reads
            key = rng.choice([k for k in entry if k in COCO_READ[section]])
            wrong = [v for k, vs in KINDS.items() if k != _kind(entry[key]) for v in vs]
            entry[key] = rng.choice([v for v in wrong if not (key in ("id", "image_id") and isinstance(v, str))])
            if section == "images" and key == "id":
                continue  # an image's id may be any integer or string; other images' references then miss it
            yield json.dumps(data), [f"{section}[", key]
        else:
            ann = rng.choice(data["annotations"])
            ann["bbox"][rng.randrange(4)] = "@NUM@"
            yield json.dumps(data).replace('"@NUM@"', rng.choice(["NaN", "Infinity", "1e400", "9" * 5000])), []


def test_hostile_coco_json_is_one_line(coco):
    root, path, valid = coco
    kinds = 0
    for text, words in coco_mutants(valid, random.Random(SEED), 14):
        path.write_text(text)
        _coco_refusal(root, path, *words)
        kinds += 1
    assert kinds >= 10


def test_coco_controls_show_the_attacks_live(coco):
    from detectron2.data.datasets.coco import load_coco_json

    root, path, valid = coco
    with pytest.raises(RecursionError):
        json.loads(_deep(200_000))
    data = copy.deepcopy(valid)
    data["annotations"].append(copy.deepcopy(data["annotations"][0]))
    path.write_text(json.dumps(data))
    with pytest.raises(AssertionError):  # detectron2's own assertion: a traceback
        load_coco_json(str(path), str(root / "coco" / "val2017"), "coco_2017_val")
    data = copy.deepcopy(valid)
    data["annotations"][0]["segmentation"] = {"size": [10, 10]}
    path.write_text(json.dumps(data))
    with pytest.raises(KeyError):
        load_coco_json(str(path), str(root / "coco" / "val2017"), "coco_2017_val")


def voc_mutants(valid_xml: str, rng: random.Random, n: int):
    """(xml text, words the refusal must hold) from one valid annotation."""
    for _ in range(n):
        kind = rng.choice(["size", "box", "class", "entity", "deep"])
        if kind == "size":
            tag = rng.choice(["width", "height"])
            value = rng.choice(["-1", "0", "1e9", "abc", "", "99999999999"])
            start, end = valid_xml.index(f"<{tag}>") + len(tag) + 2, valid_xml.index(f"</{tag}>")
            yield valid_xml[:start] + value + valid_xml[end:], ["size"]
        elif kind == "box":
            tag = rng.choice(["xmin", "ymin", "xmax", "ymax"])
            start = valid_xml.index(f"<{tag}>") + len(tag) + 2
            end = valid_xml.index(f"</{tag}>")
            yield valid_xml[:start] + rng.choice(["nan", "x", "", "1e400"]) + valid_xml[end:], []
        elif kind == "class":
            start = valid_xml.index("<name>") + 6
            end = valid_xml.index("</name>")
            yield valid_xml[:start] + rng.choice(["unicorn", "", "Dog", "../x"]) + valid_xml[end:], ["class"]
        elif kind == "entity":
            yield '<!DOCTYPE a [<!ENTITY e "xxxxxxxxxx">]>' + valid_xml.replace("<name>", "<name>&e;", 1), ["refused"]
        else:
            yield valid_xml.replace("</annotation>", "<x>" * 5000 + "</x>" * 5000 + "</annotation>"), []


def test_hostile_voc_xml_is_one_line(synthetic_root, tmp_path):
    pytest.importorskip("detectron2")
    from transfer.detection.datasets import DatasetError, VocSplit

    root = tmp_path / "data"
    shutil.copytree(synthetic_root / "VOC2007", root / "VOC2007")
    split = VocSplit("VOC2007", "test")
    ids = (root / "VOC2007" / "ImageSets" / "Main" / "test.txt").read_text().split()
    xml_path = root / "VOC2007" / "Annotations" / f"{ids[0]}.xml"
    valid = xml_path.read_text()
    refused = 0
    for text, words in voc_mutants(valid, random.Random(SEED), 16):
        xml_path.write_text(text)
        try:
            split.load("voc_2007_test", root)
        except DatasetError as e:
            one_line(e, xml_path, *words)
            refused += 1
        # a mutant that stays valid (a deep but harmless element, a box still inside) loads
    assert refused >= 8


def places_mutants(rng: random.Random, n: int):
    labels = ["205", "1000000000000", "-1", "1e3", "\u0663", "0x10", "99999999999999999999999"]
    for _ in range(n):
        yield f"a/abbey/00000001.jpg {rng.choice(labels)}\n"


def test_places205_labels_are_checked_before_anything_is_sized_by_them(synthetic_root, tmp_path):
    from transfer.datasets.readers import PLACES205_CLASSES, PLACES205_LISTS, read_places205

    root = tmp_path / "places205"
    shutil.copytree(synthetic_root / "places205", root)
    listing = root / PLACES205_LISTS / "train_places205.csv"
    valid = listing.read_text()
    for line in places_mutants(random.Random(SEED), 8):
        listing.write_text(valid + line)
        n = len((valid + line).splitlines())
        refusal(partial(read_places205, root, "train"), f"{listing}:{n}")
    # control: the label passes a check for a non-negative integer, and the class list sized by it
    # would hold 10^12 names
    label = "1000000000000"
    assert label.lstrip("-").isdigit() and int(label) >= 0 and len(range(int(label) + 1)) > 10**12 - 1
    assert len(read_places205(root.parent / "places205", "val").labels)  # the valid lists still load
    assert PLACES205_CLASSES == 205


def test_an_image_folder_with_too_many_class_folders_is_refused(tmp_path, monkeypatch):
    from transfer.datasets import readers

    monkeypatch.setattr(readers, "MAX_IMAGE_FOLDER_CLASSES", 5)
    for i in range(6):
        (tmp_path / f"c{i}").mkdir()
    refusal(partial(readers.read_image_folder, tmp_path), tmp_path, "class folders")


@pytest.mark.parametrize("spelling", ["${oc.env:SECRET_TOKEN}", "${${n}:SECRET_TOKEN}"])
def test_a_checkpoints_config_calls_no_resolver_when_analysed(spelling, tmp_path, secret_env):
    import torch

    from pretrain.analysis.__main__ import main as analysis

    config = {"n": "oc.env", "method": {"name": spelling}}
    assert OmegaConf.create(config).method.name == SECRET  # control: reading it reads the environment
    src = tmp_path / "checkpoint_last.pth"
    torch.save({"method": {}, "optimizer": {}, "step": 1, "config": config}, src)
    with pytest.raises(SystemExit) as e:
        analysis(["npc", str(src)])
    assert str(src) in e.value.code and "interpolation" in e.value.code and SECRET not in e.value.code


def number_mutants(valid: dict, rng: random.Random, n: int):
    """(key path, value): a size far beyond any recipe, or a float that is not finite."""
    from pretrain.config import RANGES

    floats = [p for p, v in _leaves(valid) if isinstance(v, float)]
    for _ in range(n):
        if rng.random() < 0.5:
            sizes = (k for k in RANGES if 2**16 <= RANGES[k].high < math.inf and not k.endswith(".N"))  # not an lr
            key = rng.choice(sorted(sizes))
            yield tuple(key.split(".")), rng.choice([RANGES[key].high + 1, 10**13, 2**63])
        else:
            yield rng.choice(floats), rng.choice([float("nan"), float("inf"), -float("inf")])


def test_huge_and_non_finite_numbers_in_a_recipe_are_one_line(valid_recipe, tmp_path):
    from pretrain.config import load_config
    from pretrain.methods.supervised import Supervised

    for path, value in number_mutants(valid_recipe, random.Random(SEED), 10):
        body = _nested(path, value)
        base = REPO / "configs" / "pretrain" / ("tiny_supervised.yaml" if "num_classes" in path else "tiny_simclr.yaml")
        recipe = _write_recipe(tmp_path, body, base=base)
        refusal(partial(load_config, recipe), recipe, ".".join(path))
    # control: the method's own check lets a 2,000,000-wide head through
    cfg = OmegaConf.create({"method": {"num_classes": 2_000_000, "label_smoothing": 0.0}})
    Supervised.check(cfg, 1)


def test_an_analysis_checkpoint_asking_for_a_huge_head_is_one_line(tmp_path):
    import torch

    from pretrain.analysis.__main__ import main as analysis
    from pretrain.config import load_config

    config = OmegaConf.to_container(load_config(REPO / "configs" / "pretrain" / "tiny_supervised.yaml"))
    config["method"]["num_classes"] = 2_000_000
    src = tmp_path / "checkpoint_last.pth"
    torch.save({"method": {}, "optimizer": {}, "step": 1, "config": config}, src)
    with pytest.raises(SystemExit) as e:
        analysis(["npc", str(src)])
    assert str(src) in e.value.code and "method.num_classes" in e.value.code and "\n" not in e.value.code.strip()


def test_a_file_name_that_is_not_utf8_is_written_escaped(tmp_path):
    from contrastive_transfer.paths import printable
    from pretrain.data import BadImageTracker, UnreadableImagesError

    name = os.fsdecode(os.fsencode(tmp_path) + b"/caf\xe9.jpg")  # Latin-1 bytes, not UTF-8
    with pytest.raises(UnicodeEncodeError):  # control: the name as Python holds it cannot be written as UTF-8
        (tmp_path / "list.txt").write_text(name + "\n")
    (tmp_path / "list.txt").write_text(printable(name) + "\n")
    assert (tmp_path / "list.txt").read_bytes().endswith(b"caf\\xe9.jpg\n")
    assert os.fsencode(name).endswith(b"caf\xe9.jpg")  # the escape names the very bytes
    tracker = BadImageTracker(0.0)
    tracker.update([name], 1)
    with pytest.raises(UnreadableImagesError) as e:
        tracker.check()
    assert "caf\\xe9.jpg" in str(e.value) and str(e.value).encode("utf-8")
