"""Hugging Face -> framework: tiny random ``LlamaForCausalLM`` models made here with transformers
(no download), loaded through ``model.init_from`` on 1 rank and on 2 gloo ranks (FSDP, TP); the
logits must equal transformers' within 1e-5 (fp32, CPU).

The models cover GQA and MHA, tied and untied heads, a sharded save (index json) and 3-head models
whose FSDP shards of q/k end in the middle of a head (the RoPE rows are permuted per head, so that
case reads the whole heads a shard touches); two are ``Qwen3ForCausalLM`` (q/k norms, whose entries
are permuted too, and a head_dim other than hidden / heads).
"""

from __future__ import annotations

import dataclasses
import json
import re
import shutil
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers", reason="transformers is in the dev extra: the parity tests compare with its models")

from framework.checkpoint import export_hf, import_hf, init_from  # noqa: E402
from framework.config.schema import Config, ModelConfig, ModelFamily, Strategy  # noqa: E402
from framework.models import (  # noqa: E402
    build_model,
    materialize,
    model_spec,  # noqa: E402
)
from framework.parallel import build_mesh, parallelize  # noqa: E402
from framework.planner.resolve import make_plan  # noqa: E402
from tests.dist import run_ranks  # noqa: E402

SEQ, TOL = 16, 1e-5
# Llama 3.1's RoPE scaling, with an original context short enough that every band is exercised.
LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0}
LLAMA3_ROPE |= {"original_max_position_embeddings": 32, "rope_theta": 500000.0}
# name -> (hidden, heads, kv heads, tied, max_shard_size for save_pretrained or None, rope parameters
# [, family, head_dim])
MODELS = {
    "gqa_untied": (64, 4, 2, False, "40KB", None),  # sharded: model.safetensors.index.json
    "gqa_tied_3heads": (48, 3, 1, True, None, None),
    "mha_tied": (64, 4, 4, True, None, None),
    "mha_untied": (64, 4, 4, False, None, None),
    "gqa_llama3_rope": (64, 4, 2, True, None, LLAMA3_ROPE),
    "qwen3_gqa_tied_hd32": (64, 4, 2, True, None, None, "qwen3", 32),
    "qwen3_untied_3heads_hd24": (48, 3, 1, False, "40KB", None, "qwen3", 24),
}


def make_hf_model(
    out: Path,
    hidden: int,
    heads: int,
    kv: int,
    tied: bool,
    shard: str | None,
    rope: dict | None,
    family: str = "llama",
    head_dim: int | None = None,
) -> None:
    from transformers import AutoModelForCausalLM, LlamaConfig, Qwen3Config

    torch.manual_seed(hash((hidden, heads, kv, tied)) % 1000)
    extra = {"rope_parameters": rope} if rope else {}
    extra |= {"head_dim": head_dim} if head_dim else {}
    config = (LlamaConfig if family == "llama" else Qwen3Config)(
        **extra,
        hidden_size=hidden,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=heads,
        num_key_value_heads=kv,
        vocab_size=256,
        tie_word_embeddings=tied,
        max_position_embeddings=64,
        rms_norm_eps=1e-5,
        rope_theta=500000.0,
    )
    model = AutoModelForCausalLM.from_config(config).eval()
    assert type(model).__name__ == ("LlamaForCausalLM" if family == "llama" else "Qwen3ForCausalLM")
    with torch.no_grad():  # non-trivial norms (q/k norms too): a swapped or unpermuted norm would show
        for n, p in model.named_parameters():
            if n.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
    model.save_pretrained(out, **({"max_shard_size": shard} if shard else {}))


def tokens() -> torch.Tensor:
    return torch.randint(0, 256, (2, SEQ), generator=torch.Generator().manual_seed(1))


def hf_logits(path: Path) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path).eval()  # fp32: what the models were saved in
    with torch.no_grad():
        return model(tokens()).logits


@pytest.fixture(scope="module")
def hf_models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, torch.Tensor]]:
    """name -> (folder, transformers' logits on ``tokens()``); shared by this module's tests and
    by tests/checkpoint/test_init_from.py."""
    root = tmp_path_factory.mktemp("hf")
    out = {}
    for name, spec in MODELS.items():
        make_hf_model(root / name, *spec)
        out[name] = (root / name, hf_logits(root / name))
    return out


def model_cfg(path: Path) -> ModelConfig:
    shape = import_hf.model_shape(import_hf.read_hf_checkpoint(path))
    return dataclasses.replace(ModelConfig(), **shape, init_from=str(path))


def test_shape_comes_from_config_json(hf_models: dict) -> None:
    path, _ = hf_models["gqa_untied"]
    assert (path / import_hf.INDEX_FILE).is_file()
    assert len({f for f in import_hf.read_hf_checkpoint(path).files.values()}) > 1
    cfg = model_cfg(path)
    assert (cfg.dim, cfg.n_heads, cfg.n_kv_heads, cfg.ffn_dim, cfg.vocab_size) == (64, 4, 2, 96, 256)
    assert (cfg.tie_embeddings, cfg.rope_theta, cfg.n_layers) == (False, 500000.0, 2)
    assert (cfg.family, cfg.head_dim) == (ModelFamily.llama, 0)  # 0: hidden / heads, as config.json says
    qwen3 = model_cfg(hf_models["qwen3_untied_3heads_hd24"][0])
    assert (qwen3.family, qwen3.head_dim, qwen3.n_heads, qwen3.dim) == (ModelFamily.qwen3, 24, 3, 48)
    assert qwen3.rope_theta == 500000.0 and not qwen3.tie_embeddings


def test_one_rank_logits_equal_transformers_and_export_back(tmp_path: Path, hf_models: dict) -> None:
    """Loaded: our logits equal transformers'. Exported again: transformers' logits on the export
    equal ours (config.json round trip, RoPE scaling included)."""
    diffs, back = {}, {}
    for name, (path, expected) in hf_models.items():
        cfg = model_cfg(path)
        model = build_model(cfg, SEQ)
        materialize(model, "cpu", seed=0, load_weights=init_from.load)
        with torch.no_grad():
            ours = model(tokens())
        diffs[name] = (ours - expected).abs().max().item()
        export_hf(model.state_dict(), cfg, tmp_path / name, max_position_embeddings=64)
        back[name] = (hf_logits(tmp_path / name) - ours).abs().max().item()
    print("HF -> framework, 1 rank, max |logits diff|:", diffs)
    print("framework -> HF (same weights), max |logits diff|:", back)
    assert max(diffs.values()) <= TOL and max(back.values()) <= TOL, (diffs, back)
    assert model_cfg(hf_models["gqa_llama3_rope"][0]).rope_scaling_factor == 8.0
    # Without the scaling the llama3 model's logits differ: the test can fail.
    plain = dataclasses.replace(model_cfg(hf_models["gqa_llama3_rope"][0]), rope_scaling_factor=1.0)
    model = build_model(plain, SEQ)
    materialize(model, "cpu", seed=0, load_weights=init_from.load)
    with torch.no_grad():
        assert (model(tokens()) - hf_models["gqa_llama3_rope"][1]).abs().max().item() > 1e-3


def _parallel_logits(rank: int, world: int, models: dict, layouts: list[tuple[str, int, list[int]]]) -> dict:
    """On each rank: for every model and layout (strategy, tp degree, mesh shape), build as the
    trainer does and compare the logits with transformers'."""
    diffs = {}
    for name, (path, expected) in models.items():
        for strategy, tp, shape in layouts:
            cfg = model_cfg(path)
            if cfg.n_heads % tp or cfg.n_kv_heads % tp:
                continue
            full = Config(model=cfg)
            full.mesh.shape = shape
            full.sharding.strategy, full.sharding.tp = Strategy(strategy), tp
            full.train.seq_len, full.train.global_batch_size = SEQ, world // tp
            full.train.micro_batch_size = 1
            plan = make_plan(full)
            mesh = build_mesh(plan, "cpu")
            model = parallelize(
                build_model(cfg, SEQ),
                mesh,
                plan,
                full.sharding,
                full.bucketing,
                full.executor,
                torch.device("cpu"),
                0,
                load_weights=init_from.load,
            )
            if strategy != "ddp":  # each rank holds (and so read) only its shards
                local = sum(p.to_local().numel() for p in model.parameters())
                assert local < sum(p.numel() for p in model.parameters()), (name, strategy)
            with torch.no_grad():
                diffs[f"{name}/{strategy}"] = (model(tokens()) - expected).abs().max().item()
    return diffs


def test_two_gloo_ranks_fsdp_and_tp_logits_equal_transformers(hf_models: dict) -> None:
    layouts = [("fsdp", 1, [2]), ("tp", 2, [2])]
    out = run_ranks(_parallel_logits, 2, hf_models, layouts, timeout_s=300)
    print("HF -> framework, 2 gloo ranks, max |logits diff| (rank 0):", out[0])
    assert len(out[0]) == 2 * len(MODELS) - 2  # TP skips the 3-head models
    for diffs in out:
        assert max(diffs.values()) <= TOL, diffs


def test_shape_and_name_mismatch_name_the_tensor(hf_models: dict) -> None:
    path, _ = hf_models["mha_tied"]
    ckpt = import_hf.read_hf_checkpoint(path)
    expected = {n: tuple(p.shape) for n, p in build_model(model_cfg(path), SEQ).named_parameters()}
    names = model_spec(model_cfg(path)).hf_names()
    wrong = dict(expected, **{"layers.1.feed_forward.w1.weight": (128, 64)})
    with pytest.raises(
        ValueError,
        match=r"model\.layers\.1\.mlp\.gate_proj\.weight has shape \[96, 64\], the model expects \[128, 64\]",
    ):
        import_hf.check_against(ckpt, wrong, names)
    untied = dict(expected, **{"output.weight": (256, 64)})  # the model wants an lm_head it lacks
    with pytest.raises(ValueError, match=r"missing \['lm_head.weight'\]"):
        import_hf.check_against(ckpt, untied, names)


def test_unsupported_configs_are_refused(tmp_path: Path, hf_models: dict) -> None:
    src, _ = hf_models["mha_tied"]
    for change, match in [
        ({"rope_parameters": {"rope_type": "yarn", "factor": 8.0, "rope_theta": 5e5}}, "RoPE scaling"),
        ({"rope_scaling": {"type": "linear", "factor": 8.0}}, "linear"),
        ({"model_type": "gemma"}, "model_type='gemma'"),
        ({"attention_bias": True}, "attention_bias=true"),
        ({"use_sliding_window": True}, "use_sliding_window=true"),
    ]:
        folder = tmp_path / match.split("=")[0].replace(" ", "_")
        folder.mkdir()
        shutil.copy(src / "model.safetensors", folder / "model.safetensors")  # a link out is refused
        conf = json.loads((src / "config.json").read_text()) | change
        (folder / "config.json").write_text(json.dumps(conf))
        with pytest.raises(ValueError, match=match):
            import_hf.model_shape(import_hf.read_hf_checkpoint(folder))


def _folder_with(tmp_path: Path, src: Path, name: str, config: object, generation: object = None) -> Path:
    """A copy of the HF folder ``src`` with ``config`` as its config.json (and a generation_config.json)."""
    folder = tmp_path / name
    folder.mkdir()
    shutil.copy(src / "model.safetensors", folder / "model.safetensors")
    (folder / "config.json").write_text(json.dumps(config))
    if generation is not None:
        (folder / "generation_config.json").write_text(json.dumps(generation))
    return folder


def test_a_config_json_or_rope_settings_of_the_wrong_json_type_are_one_line(
    tmp_path: Path, hf_models: dict
) -> None:
    """config.json a list, rope_scaling a string: AttributeError tracebacks."""
    src, _ = hf_models["mha_tied"]
    conf = json.loads((src / "config.json").read_text())
    cases = [
        ([conf], r"config.json is a JSON list; valid: a JSON object"),
        (conf | {"rope_scaling": "linear"}, r"config.json has rope_scaling='linear'; valid: null or an object"),
        (conf | {"rope_parameters": 8}, r"config.json has rope_parameters=8; valid: null or an object"),
    ]
    for i, (config, match) in enumerate(cases):
        folder = _folder_with(tmp_path, src, str(i), config)
        with pytest.raises(ValueError, match=rf"^model.init_from='{folder}': {match}"):
            import_hf.model_shape(import_hf.read_hf_checkpoint(folder))


@pytest.mark.parametrize("eos", ["2", -1, 256, True, [], [2, "x"]])
def test_an_eos_token_id_that_is_not_a_token_of_the_model_is_one_line(
    tmp_path: Path, hf_models: dict, eos: object
) -> None:
    """generation_config.json's eos_token_id: a string, -1, an id past the vocabulary (256 here) or a
    list with one was dropped silently, so generate never stopped where the model's authors meant."""
    from framework.generate.decode import generation_stop_ids

    src, _ = hf_models["mha_tied"]
    conf = json.loads((src / "config.json").read_text())
    folder = _folder_with(tmp_path, src, "eos", conf, {"eos_token_id": eos})
    shown = f"eos_token_id={eos!r}; valid: null, a token id in 0..255 or a non-empty list of them"
    with pytest.raises(ValueError, match=re.escape(f"generation_config.json has {shown}")):
        import_hf.read_generation_config(folder, "model.init_from", 256)
    with pytest.raises(ValueError, match=re.escape(shown)):
        generation_stop_ids(folder, 256)
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 255]}))
    assert generation_stop_ids(folder, 256) == {2, 255}


@pytest.mark.parametrize("where", ["dotdot", "absolute", "subfolder"])
def test_index_naming_a_path_outside_the_folder_is_refused(
    tmp_path: Path, hf_models: dict, where: str
) -> None:
    """A weight_map entry is a file name in the folder: ``..``, an absolute path or a subfolder is
    refused, even when the file it names is a readable shard of the same model."""
    import json
    import shutil

    src, _ = hf_models["gqa_untied"]
    folder, outside = tmp_path / "model", tmp_path / "outside"
    shutil.copytree(src, folder)
    index = json.loads((folder / import_hf.INDEX_FILE).read_text())
    tensor, shard = next(iter(index["weight_map"].items()))
    outside.mkdir()
    (folder / "sub").mkdir()
    shutil.copy(folder / shard, outside / shard)
    shutil.copy(folder / shard, folder / "sub" / shard)
    name = {"dotdot": f"../outside/{shard}", "absolute": str(outside / shard), "subfolder": f"sub/{shard}"}
    index["weight_map"] = {t: name[where] if f == shard else f for t, f in index["weight_map"].items()}
    (folder / import_hf.INDEX_FILE).write_text(json.dumps(index))
    with pytest.raises(ValueError, match=r"weight_map; valid: the file name") as e:
        import_hf.read_hf_checkpoint(folder)
    assert name[where] in str(e.value) and "\n" not in str(e.value) and tensor


def hub_cache_snapshot(src: Path, root: Path, repo: str = "models--team--tiny") -> Path:
    """``src`` laid out as the Hugging Face hub cache lays out a download: each file once in
    ``REPO/blobs/SHA256``, and ``REPO/snapshots/REV/NAME`` a relative link ``../../blobs/SHA256``."""
    import hashlib
    import os

    blobs, snap = root / repo / "blobs", root / repo / "snapshots" / "0123abcd"
    blobs.mkdir(parents=True)
    snap.mkdir(parents=True)
    (root / repo / "refs").mkdir()
    (root / repo / "refs" / "main").write_text("0123abcd")
    for f in sorted(src.iterdir()):
        digest = hashlib.sha256(f.read_bytes()).hexdigest()
        (blobs / digest).write_bytes(f.read_bytes())
        os.symlink(f"../../blobs/{digest}", snap / f.name)
    return snap


def test_a_hub_cache_snapshot_reads_and_links_out_of_it_are_refused(tmp_path: Path, hf_models: dict) -> None:
    """The hub cache's links (snapshots/REV/x -> ../../blobs/HASH, same cache repo) are read, and
    give what the plain folder gives (transformers agrees); a link anywhere else (another folder,
    another cache repo's blobs) or a link loop is one line naming the file and what is valid."""
    import os
    import shutil

    src, logits = hf_models["gqa_untied"]  # sharded: config.json, the index and two shards, all links
    snap = hub_cache_snapshot(src, tmp_path)
    assert all(p.is_symlink() for p in snap.iterdir())
    ckpt = import_hf.read_hf_checkpoint(snap)
    assert ckpt.shapes == import_hf.read_hf_checkpoint(src).shapes
    assert torch.equal(hf_logits(snap), logits)
    model = build_model(model_cfg(snap), SEQ)
    materialize(model, "cpu", 0, init_from.load)  # reads the weights through the links
    assert torch.allclose(model(tokens()), logits, atol=TOL)

    outside = tmp_path / "outside"
    outside.mkdir()
    other = hub_cache_snapshot(src, tmp_path, "models--other--model")
    shard = json.loads((src / import_hf.INDEX_FILE).read_text())["weight_map"]["model.embed_tokens.weight"]
    cases = {
        "config.json": outside / "config.json",  # a file elsewhere (a user's secret, another model)
        shard: (other / shard).resolve(),  # the blob of another cache repo
    }
    shutil.copy(src / "config.json", outside / "config.json")
    blobs = tmp_path / "models--team--tiny" / "blobs"
    for i, (name, target) in enumerate(cases.items()):
        bad = snap.parent / f"bad{i}"  # a sibling snapshot: its relative links into blobs/ still resolve
        shutil.copytree(snap, bad, symlinks=True)
        (bad / name).unlink()
        os.symlink(target, bad / name)
        with pytest.raises(ValueError) as e:
            import_hf.read_hf_checkpoint(bad)
        msg = str(e.value)
        assert (
            f"{name} is a symlink to {str(target)!r}, outside the folder; valid: files in the folder" in msg
        )
        assert f"or links into {str(blobs)!r} (the same Hugging Face cache repo)" in msg and "\n" not in msg
    loop = snap.parent / "loop"
    shutil.copytree(snap, loop, symlinks=True)
    (loop / "config.json").unlink()
    os.symlink("config.json", loop / "config.json")
    with pytest.raises(ValueError, match=r"config.json is a symlink that does not lead to a file"):
        import_hf.read_hf_checkpoint(loop)


def test_train_py_refuses_an_init_from_link_out_of_the_folder_in_one_line(
    tmp_path: Path, hf_models: dict
) -> None:
    import os

    from tests.entry import train_forked

    src, _ = hf_models["gqa_tied_3heads"]
    snap = hub_cache_snapshot(src, tmp_path)
    secret = tmp_path / "secret.json"
    secret.write_text((src / "config.json").read_text())
    (snap / "config.json").unlink()
    os.symlink(secret, snap / "config.json")
    run = tmp_path / "run"
    proc = train_forked(  # python train.py, forked from this process (tests/entry.py)
        f"hydra.run.dir={run}", f"model.init_from={snap}", "run.dry_run=true",
        env={**os.environ, "OMP_NUM_THREADS": "1"}, timeout=180,
    )  # fmt: skip
    assert proc.returncode == 2, proc.stderr[-2000:]
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
    assert (
        len(errors) == 1 and f"config.json is a symlink to {str(secret)!r}, outside the folder" in errors[0]
    )
    assert "Traceback" not in proc.stderr and not run.exists()
