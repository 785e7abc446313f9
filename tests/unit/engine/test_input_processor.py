import dataclasses
import json
import pickle
import shutil

import pytest

from bladellm.errors import ContextLengthError
from bladellm.engine.input_processor import InputProcessor
from bladellm.engine.model_info import load_model_info
from bladellm.sampling_params import SamplingParams


@pytest.fixture(scope="module")
def info(tiny_llama):
    return load_model_info(tiny_llama)


@pytest.fixture(scope="module")
def proc(info):
    return InputProcessor(info)


# --- model info --------------------------------------------------------------------------------

def test_model_info_of_tiny_llama(info, tiny_llama):
    assert info.eos_token_ids == [2]  # <|im_end|>: generation_config and tokenizer agree
    assert info.max_model_len == 512
    assert info.vocab_size == 384
    assert info.has_chat_template
    assert info.served_model_name == tiny_llama.rstrip("/").split("/")[-1]
    assert info.sampling_defaults == {}  # the tiny generation_config sets no sampling fields


def test_generation_config_sets_eos_union_and_sampling_defaults(tiny_llama, tmp_path):
    model_dir = tmp_path / "m"
    shutil.copytree(tiny_llama, model_dir)
    gen = {"eos_token_id": [0, 2], "temperature": 0.7, "top_p": 0.8, "top_k": 20,
           "repetition_penalty": 1.05, "do_sample": True, "max_new_tokens": 99}
    (model_dir / "generation_config.json").write_text(json.dumps(gen))
    info = load_model_info(str(model_dir), served_model_name="tiny", max_model_len=256)
    assert info.eos_token_ids == [0, 2]
    assert info.sampling_defaults == {"temperature": 0.7, "top_p": 0.8, "top_k": 20,
                                      "repetition_penalty": 1.05}
    assert info.served_model_name == "tiny"
    assert info.max_model_len == 256


def test_preloaded_config_and_tokenizer_are_used(info, tiny_llama):
    config = type(info.hf_config)(max_position_embeddings=64, vocab_size=400)
    loaded = load_model_info(tiny_llama, hf_config=config, tokenizer=info.tokenizer)
    assert loaded.tokenizer is info.tokenizer
    assert (loaded.max_model_len, loaded.vocab_size) == (64, 400)


def test_max_model_len_above_the_model_limit_is_rejected(tiny_llama):
    with pytest.raises(ValueError, match=r"max_model_len.*1024.*512"):
        load_model_info(tiny_llama, max_model_len=1024)


def test_missing_tokenizer_names_the_directory(tiny_llama, tmp_path):
    with pytest.raises(ValueError, match=str(tmp_path)):
        load_model_info(tiny_llama, tokenizer_dir=str(tmp_path))


# --- process -----------------------------------------------------------------------------------

def test_text_prompt_is_tokenized(proc, info):
    (req,) = proc.process("r1", "hello world", SamplingParams(max_tokens=4), arrival_time=5.0)
    assert req.request_id == "r1"
    assert req.prompt_token_ids == info.tokenizer.encode("hello world")
    assert req.arrival_time == 5.0
    assert req.sampling_params.max_tokens == 4


def test_token_prompt_is_kept(proc):
    (req,) = proc.process("r1", [5, 6, 7], SamplingParams(), arrival_time=0.0)
    assert req.prompt_token_ids == [5, 6, 7]


@pytest.mark.parametrize("prompt", ["", []])
def test_empty_prompt_is_rejected(proc, prompt):
    with pytest.raises(ValueError, match="empty"):
        proc.process("r", prompt, SamplingParams(), 0.0)


def test_out_of_vocab_prompt_token_is_rejected(proc):
    with pytest.raises(ValueError, match="384"):
        proc.process("r", [1, 384], SamplingParams(), 0.0)
    with pytest.raises(ValueError, match="out of the vocabulary"):
        proc.process("r", [-1], SamplingParams(), 0.0)


def test_prompt_plus_max_tokens_over_context_is_rejected(proc):
    proc.process("r", [1] * 500, SamplingParams(max_tokens=12), 0.0)  # exactly 512: fine
    with pytest.raises(ContextLengthError,
                       match=r"500 tokens.*max_tokens \(13\).*513.*512") as e:
        proc.process("r", [1] * 500, SamplingParams(max_tokens=13), 0.0)
    # The front end names the field from these (max_tokens here: the prompt alone fits).
    assert (e.value.num_prompt_tokens, e.value.max_tokens, e.value.max_model_len) == \
        (500, 13, 512)
    assert isinstance(e.value, ValueError) and not e.value.prompt_overflows
    proc.process("r", [1] * 511, SamplingParams(max_tokens=None), 0.0)
    with pytest.raises(ContextLengthError, match=r"512 tokens.*512") as e:
        proc.process("r", [1] * 512, SamplingParams(max_tokens=None), 0.0)
    assert e.value.prompt_overflows
    again = pickle.loads(pickle.dumps(e.value))  # crosses process boundaries intact
    assert (str(again), again.num_prompt_tokens, again.max_tokens) == (str(e.value), 512, None)


def test_out_of_vocab_stop_token_ids_and_logit_bias_name_the_field(proc):
    with pytest.raises(ValueError, match="stop_token_ids"):
        proc.process("r", [1], SamplingParams(stop_token_ids=[2, 400]), 0.0)
    with pytest.raises(ValueError, match="logit_bias"):
        proc.process("r", [1], SamplingParams(logit_bias={999: 1.0}), 0.0)
    proc.process("r", [1], SamplingParams(stop_token_ids=[383], logit_bias={383: 1.0}), 0.0)


def test_n_fans_out_into_children_with_consecutive_seeds(proc):
    reqs = proc.process("req", "hello", SamplingParams(n=3, seed=7, temperature=0.8), 1.0)
    assert [r.request_id for r in reqs] == ["req-0", "req-1", "req-2"]
    assert [r.sampling_params.seed for r in reqs] == [7, 8, 9]
    assert all(r.sampling_params.n == 1 for r in reqs)
    assert all(r.sampling_params.temperature == 0.8 for r in reqs)
    assert len({tuple(r.prompt_token_ids) for r in reqs}) == 1

    unseeded = proc.process("u", "hello", SamplingParams(n=2), 1.0)
    assert [r.sampling_params.seed for r in unseeded] == [None, None]

    top = proc.process("t", "hello", SamplingParams(n=2, seed=2**63 - 1), 1.0)
    assert [r.sampling_params.seed for r in top] == [2**63 - 1, -(2**63)]


def test_only_the_first_child_computes_prompt_logprobs(proc):
    """The parent shows one set of prompt logprobs: the other samples neither compute them nor
    give up their prompt-cache hits for them."""
    reqs = proc.process("p", "hello", SamplingParams(n=3, prompt_logprobs=2), 1.0)
    assert [r.sampling_params.prompt_logprobs for r in reqs] == [2, None, None]


# --- chat template -----------------------------------------------------------------------------

def test_chat_template_renders_chatml(proc):
    messages = [{"role": "system", "content": "be brief"},
                {"role": "user", "content": [{"type": "text", "text": "hi"},
                                             {"type": "text", "text": "there"}]}]
    text = proc.apply_chat_template(messages)
    assert text == ("<|im_start|>system\nbe brief<|im_end|>\n"
                    "<|im_start|>user\nhi\nthere<|im_end|>\n<|im_start|>assistant\n")
    assert not proc.apply_chat_template(messages, add_generation_prompt=False).endswith(
        "assistant\n")


@pytest.mark.parametrize("messages, match", [
    ([], "non-empty"),
    ("hi", "non-empty"),
    ([{"role": "robot", "content": "x"}], "role"),
    ([{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}], "text"),
    ([{"role": "user", "content": 3}], "content"),
])
def test_bad_chat_messages_are_rejected(proc, messages, match):
    with pytest.raises(ValueError, match=match):
        proc.apply_chat_template(messages)


def test_chat_without_template_is_rejected(info):
    proc = InputProcessor(dataclasses.replace(info, has_chat_template=False))
    with pytest.raises(ValueError, match="chat template"):
        proc.apply_chat_template([{"role": "user", "content": "hi"}])
