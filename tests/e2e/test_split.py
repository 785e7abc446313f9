"""``blade_llm_split``: a checkpoint split per TP rank serves the same greedy tokens as the
original at world size 1 (fp32), each rank reading only its own shard (about 1/T of the
weights); a quantized checkpoint splits as its packed shards; a split served with another degree
is refused with a ``ValueError`` naming the flag."""

from __future__ import annotations

import json
import os

import pytest
import torch

from bladellm import LLM, SamplingParams
from bladellm.entrypoints.cli.split import main as split_main, split_checkpoint
from bladellm.model.loader import SPLIT_MANIFEST

MAX_TOKENS = 12
OPTS = dict(dtype="float32", max_model_len=128, num_kv_blocks=64, block_size=8)
UNEVEN = dict(num_attention_heads=12, num_key_value_heads=4, hidden_size=96,
              intermediate_size=100)


def _prompts(vocab: int) -> list[list[int]]:
    return [[(7 * i + 3 * j) % (vocab - 3) + 3 for j in range(5 + 3 * i)] for i in range(4)]


def _greedy(model_dir: str, tp: int, prompts: list[list[int]], pp: int = 1) -> list[list[int]]:
    llm = LLM(model=model_dir, tensor_parallel_size=tp, pipeline_parallel_size=pp, **OPTS)
    try:
        outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS),
                            use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outs]
    finally:
        llm.shutdown()


def _weights_bytes(d: str) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for f in os.listdir(d)
               if f.endswith(".safetensors"))


@pytest.fixture(scope="module")
def uneven_split(tiny_model_factory, tmp_path_factory):
    src = tiny_model_factory("llama", **UNEVEN)
    out = str(tmp_path_factory.mktemp("split-T3"))
    assert split_main(["--tensor_parallel_size", "3", "--model", src,
                       "--output_dir", out, "--overwrite"]) == 0
    return src, out


def test_split_layout_and_sizes(uneven_split):
    src, out = uneven_split
    manifest = json.load(open(os.path.join(out, SPLIT_MANIFEST)))
    assert manifest["tensor_parallel_size"] == 3 and manifest["format_version"] == 1
    for name in ("config.json", "tokenizer.json", "generation_config.json"):
        assert os.path.isfile(os.path.join(out, name)), name
    full = _weights_bytes(src)
    sizes = [_weights_bytes(os.path.join(out, f"rank_{r}")) for r in range(3)]
    # 6+3+3 query / 2+1+1 KV heads: rank 0 holds twice the attention of the others; norms are
    # replicated. Every rank stays well under half of the full checkpoint.
    assert all(s < 0.45 * full for s in sizes), (sizes, full)
    assert 0.95 * full < sum(sizes) < 1.15 * full, (sizes, full)


def test_split_T3_uneven_serves_same_tokens(uneven_split):
    src, out = uneven_split
    prompts, want = _original_greedy(src)
    assert _greedy(out, 3, prompts) == want


def test_split_T2_default_llama_serves_same_tokens(tiny_llama, tmp_path):
    out = str(tmp_path / "split-T2")
    manifest = split_checkpoint(tiny_llama, out, 2)
    full = _weights_bytes(tiny_llama)
    for r in manifest["ranks"]:
        assert r["bytes"] < 0.6 * full, (r, full)  # 1/2 plus replicated norms
    prompts, want = _original_greedy(tiny_llama)
    assert _greedy(out, 2, prompts) == want


def test_split_P2_tied_serves_same_tokens_and_refuses_another_P(tiny_model_factory, tmp_path):
    """Two stages of a 3-layer model with a tied LM head: stage 0 holds the embedding and 2
    layers, stage 1 one layer, the norm and the LM head (the embedding's values)."""
    src = tiny_model_factory("llama", num_hidden_layers=3, tie_word_embeddings=True)
    out = str(tmp_path / "split-P2")
    assert split_main(["-tp", "1", "-pp", "2", "--model", src, "--output_dir", out]) == 0
    manifest = json.load(open(os.path.join(out, SPLIT_MANIFEST)))
    assert manifest["pipeline_parallel_size"] == 2 and len(manifest["ranks"]) == 2
    from safetensors import safe_open

    names = []
    for r in range(2):
        with safe_open(os.path.join(out, f"rank_{r}", "model.safetensors"), "pt") as f:
            names.append(set(f.keys()))
    assert "model.embed_tokens.weight" in names[0] and "lm_head.weight" not in names[0]
    assert "lm_head.weight" in names[1] and "model.embed_tokens.weight" not in names[1]
    assert any(n.startswith("model.layers.1.") for n in names[0])
    assert not any(n.startswith("model.layers.2.") for n in names[0])
    assert any(n.startswith("model.layers.2.") for n in names[1])
    assert "model.norm.weight" in names[1] and "model.norm.weight" not in names[0]
    prompts, want = _original_greedy(src)
    assert _greedy(out, 1, prompts, pp=2) == want
    with pytest.raises(ValueError, match="--pipeline_parallel_size 1"):
        LLM(model=out, **OPTS)


def _original_greedy(model_dir: str) -> tuple[list[list[int]], list[list[int]]]:
    """The unsplit model's greedy tokens (one rank) for the test prompts."""
    llm = LLM(model=model_dir, **OPTS)
    try:
        prompts = _prompts(llm.engine.model_info.vocab_size)
        want = [list(o.outputs[0].token_ids) for o in llm.generate(
            prompts, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS), use_tqdm=False)]
    finally:
        llm.shutdown()
    return prompts, want


@pytest.mark.parametrize("tp", [1, 2])
def test_mismatched_degree_refused(uneven_split, tp):
    _, out = uneven_split
    with pytest.raises(ValueError, match="--tensor_parallel_size"):
        LLM(model=out, tensor_parallel_size=tp, **OPTS)


def test_quantized_split_T2_serves_the_unsplit_tokens(tiny_llama, tmp_path):
    """A GPTQ 4-bit g32 checkpoint split for T=2: each rank holds its packed shard (column
    shards on whole output columns, row shards on whole groups), serving it at T=2 gives the
    unsplit checkpoint's tokens at T=1."""
    from quant_checkpoints import quantize_checkpoint
    from safetensors import safe_open

    src = tmp_path / "gptq"
    quantize_checkpoint(tiny_llama, src, "gptq", bits=4, group_size=32)
    out = str(tmp_path / "gptq-T2")
    manifest = split_checkpoint(str(src), out, 2)
    with safe_open(os.path.join(out, "rank_1", "model.safetensors"), "pt") as f:
        names = set(f.keys())
        qweight = f.get_tensor("model.layers.0.mlp.down_proj.qweight")
    assert "model.layers.0.self_attn.qkv_proj.qweight" in names
    assert not any(n.endswith("proj.weight") for n in names)  # packed, not dequantized
    assert qweight.dtype == torch.int32 and qweight.shape[0] == 64 // 8  # half of K = 128
    full = _weights_bytes(str(src))
    assert all(r["bytes"] < 0.7 * full for r in manifest["ranks"])
    prompts, want = _original_greedy(str(src))
    assert _greedy(out, 2, prompts) == want


def test_bad_inputs_refused(uneven_split, tmp_path):
    src, out = uneven_split
    with pytest.raises(ValueError, match="already split"):
        split_checkpoint(out, str(tmp_path / "again"), 3)
    with pytest.raises(ValueError, match="--tensor_parallel_size 13"):
        split_checkpoint(src, str(tmp_path / "t13"), 13)  # more ranks than query heads
    with pytest.raises(ValueError, match="not empty"):
        split_checkpoint(src, out, 3)


def test_bad_paths_and_models_refused_leaving_nothing(tiny_llama, tmp_path, capsys):
    """Each is one line naming the flag, exit status 2, and no output directory left behind."""
    import shutil

    src = tmp_path / "src"
    shutil.copytree(tiny_llama, src)
    link = tmp_path / "link"
    link.symlink_to(src)
    # a link to the model is the model (was a SameFileError traceback after writing rank_*
    # directories into the source)
    assert split_main(["-tp", "2", "--model", str(src), "--output_dir", str(link),
                       "--overwrite"]) == 2
    assert "--output_dir must differ from --model" in capsys.readouterr().err
    assert sorted(os.listdir(src)) == sorted(os.listdir(tiny_llama))
    # an --output_dir that cannot be made (was a NotADirectoryError traceback)
    a_file = tmp_path / "f"
    a_file.write_text("x")
    assert split_main(["-tp", "2", "--model", str(src), "--output_dir",
                       str(a_file / "out")]) == 2
    assert "--output_dir: cannot create" in capsys.readouterr().err
    # an architecture the engine does not build (the error named no flag and left an empty
    # --output_dir behind)
    config = json.load(open(src / "config.json"))
    config["architectures"] = ["GPT2LMHeadModel"]
    json.dump(config, open(src / "config.json", "w"))
    out = tmp_path / "new" / "out"
    assert split_main(["-tp", "2", "--model", str(src), "--output_dir", str(out)]) == 2
    assert "--model: model architecture ['GPT2LMHeadModel']" in capsys.readouterr().err
    assert not (tmp_path / "new").exists()


def test_missing_weights_hint_names_split_flags(tiny_llama, tmp_path, capsys):
    """The loader's hint was '--load_format dummy', which blade_llm_split does not take."""
    assert split_main(["-tp", "2", "--model", tiny_llama, "--output_dir", str(tmp_path / "o"),
                       "--load_format", "pt"]) == 2
    err = capsys.readouterr().err
    assert "--model" in err and "--load_format pt" in err and "dummy" not in err, err
    assert not (tmp_path / "o").exists()


def test_failed_split_leaves_no_output_dir(tiny_llama, tmp_path, monkeypatch):
    import bladellm.model.loader as loader

    def boom(*_a, **_k):
        raise RuntimeError("interrupted")

    monkeypatch.setattr(loader, "split_state_dict", boom)
    out = tmp_path / "new" / "out"
    with pytest.raises(RuntimeError, match="interrupted"):
        split_checkpoint(tiny_llama, str(out), 2)
    assert not (tmp_path / "new").exists()


def test_dtype_flag_is_the_served_dtype(tiny_llama, tmp_path):
    """--dtype bfloat16 wrote bfloat16 shards under the source's config.json (float32), so
    --dtype auto served them widened back to float32: the flag saved disk only."""
    from bladellm.model.loader import resolve_dtype
    from transformers import AutoConfig

    out = str(tmp_path / "bf16")
    manifest = split_checkpoint(tiny_llama, out, 2, dtype="bfloat16")
    assert manifest["dtype"] == "bfloat16"
    config = json.load(open(os.path.join(out, "config.json")))
    assert config["dtype"] == "bfloat16", config.get("dtype")
    # A torch.device names the platform without asking for a GPU (a bare "cuda" would).
    assert resolve_dtype(AutoConfig.from_pretrained(out), "auto",
                         torch.device("cuda")) == torch.bfloat16


def test_help_describes_pipeline_stages():
    from bladellm.entrypoints.cli.split import make_parser

    description = make_parser().description
    assert "pipeline" in description and "rank_" in description, description
