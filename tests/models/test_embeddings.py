"""Embeddings (offline ``LLM.embed``) against transformers' hidden states; vLLM's prompt forms
and chat options of the offline API (issue 15 items 7 and 10)."""

import json
import shutil

import pytest
import torch
import transformers

from bladellm import LLM, SamplingParams
from prompt_logprobs_of import prompt_logprobs_of


@pytest.fixture(scope="module")
def llm(tiny_llama):
    return LLM(model=tiny_llama, dtype="float32", num_kv_blocks=64)


@pytest.fixture(scope="module")
def hf(tiny_llama):
    return transformers.AutoModel.from_pretrained(tiny_llama, torch_dtype=torch.float32).eval()


def _hf_hidden(hf, ids):
    with torch.no_grad():
        return hf(torch.tensor([ids])).last_hidden_state[0]


def test_last_token_pooling_matches_transformers(llm, hf):
    outs = llm.embed(["The quick brown fox", "Paris is the capital"])
    for out in outs:
        ref = torch.nn.functional.normalize(_hf_hidden(hf, out.prompt_token_ids)[-1], dim=0)
        got = torch.tensor(out.embedding)
        assert torch.allclose(got, ref, atol=1e-4), (got - ref).abs().max()
        assert abs(got.norm().item() - 1) < 1e-5
    assert not torch.allclose(torch.tensor(outs[0].embedding), torch.tensor(outs[1].embedding))


def test_mean_pooling_from_sentence_transformers_config(tiny_llama, hf, tmp_path):
    model_dir = tmp_path / "st"
    shutil.copytree(tiny_llama, model_dir)
    (model_dir / "1_Pooling").mkdir()
    (model_dir / "1_Pooling" / "config.json").write_text(json.dumps(
        {"pooling_mode_mean_tokens": True, "pooling_mode_lasttoken": False}))
    llm = LLM(model=str(model_dir), dtype="float32", num_kv_blocks=40)
    (out,) = llm.embed({"prompt_token_ids": [5, 6, 7, 8]})
    ref = torch.nn.functional.normalize(_hf_hidden(hf, [5, 6, 7, 8]).mean(0), dim=0)
    assert torch.allclose(torch.tensor(out.embedding), ref, atol=1e-4)


def test_embed_errors(llm):
    with pytest.raises(ValueError, match="Matryoshka"):
        llm.embed("x", dimensions=8)
    with pytest.raises(ValueError, match="maximum context length"):
        llm.embed([[5] * 600])
    with pytest.raises(ValueError, match="prompt_token_ids"):
        llm.embed({"text": "x"})
    with pytest.raises(ValueError, match="truncate_prompt_tokens"):
        llm.embed("x", truncate_prompt_tokens=0)


def test_truncate_prompt_tokens_keeps_the_last_tokens(llm):
    long = [5 + i % 300 for i in range(600)]
    (cut,) = llm.embed([long], truncate_prompt_tokens=-1)
    (tail,) = llm.embed([long[-llm.engine.model_info.max_model_len:]])
    assert cut.prompt_token_ids == tail.prompt_token_ids and cut.embedding == tail.embedding
    (three,) = llm.embed([[9, 8, 7, 6, 5]], truncate_prompt_tokens=3)
    assert three.prompt_token_ids == [7, 6, 5]


def test_vllm_prompt_forms_and_chat_options(llm):
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    a, b, c = llm.generate(["Paris is", {"prompt": "Paris is"},
                            {"prompt_token_ids": llm.get_tokenizer().encode("Paris is")}],
                           params, use_tqdm=False)
    assert a.outputs[0].token_ids == b.outputs[0].token_ids == c.outputs[0].token_ids
    msgs = [{"role": "user", "content": "hi"}]
    (out,) = llm.chat(msgs, params, use_tqdm=False,
                      chat_template="{% for m in messages %}<|im_start|>{{ m.content }}"
                                    "{% endfor %}{{ suffix }}",
                      chat_template_kwargs={"suffix": "!"})
    tok = llm.get_tokenizer()
    assert out.prompt_token_ids == tok.encode("<|im_start|>hi!", add_special_tokens=False)
    (plain,) = llm.chat(msgs, params, use_tqdm=False)
    text = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    assert plain.prompt_token_ids == tok.encode(text, add_special_tokens=False)


def _check_against_transformers(entries, ids, ref, num_top):
    assert len(entries) == len(ids) - 1
    for pos, (tok_ids, lps, rank) in enumerate(entries):
        row = ref[pos]
        assert tok_ids[0] == ids[pos + 1]
        assert lps[0] == pytest.approx(row[ids[pos + 1]].item(), abs=1e-4)
        assert rank == int((row > row[ids[pos + 1]]).sum()) + 1
        assert tok_ids[1:] == row.topk(num_top).indices.tolist()


def test_prompt_logprobs_match_transformers(llm, tiny_llama):
    """Prompt logprobs from the request's own prefill (behind prompt_logprobs / echo +
    logprobs)."""
    lm = transformers.AutoModelForCausalLM.from_pretrained(
        tiny_llama, torch_dtype=torch.float32).eval()
    ids = llm.get_tokenizer().encode("The quick brown fox jumps over")
    (entries,) = prompt_logprobs_of(llm, [ids], 3)
    with torch.no_grad():
        ref = torch.log_softmax(lm(torch.tensor([ids])).logits[0].float(), dim=-1)
    _check_against_transformers(entries, ids, ref, 3)


def test_prompt_logprobs_across_prefill_chunks_and_cached_prefixes(tiny_llama):
    """A prompt prefilled in many chunks gives every position once; a second request with the
    same prompt (its blocks in the prompt cache) still gets them all, as does a request whose
    prefill is recomputed after preemption."""
    lm = transformers.AutoModelForCausalLM.from_pretrained(
        tiny_llama, torch_dtype=torch.float32).eval()
    llm = LLM(model=tiny_llama, dtype="float32", block_size=4, max_num_batched_tokens=8,
              num_kv_blocks=17, max_model_len=64, debug_block_accounting=True)
    ids = list(range(5, 5 + 37))
    with torch.no_grad():
        ref = torch.log_softmax(lm(torch.tensor([ids])).logits[0].float(), dim=-1)
    llm.generate([ids], SamplingParams(max_tokens=2), use_tqdm=False)  # fills the cache
    # Three requests of 12 blocks each in 16: the newest are preempted and recomputed.
    for entries in prompt_logprobs_of(llm, [ids, ids, ids], 2, max_tokens=8):
        _check_against_transformers(entries, ids, ref, 2)
    stats = llm.engine.core.scheduler.get_stats()
    assert stats.prefix_cache_hits == 0 and stats.num_preemptions > 0
    assert len(llm.engine.core.prompt_logprobs) == 0


def test_offline_prompt_logprobs_match_transformers(llm, tiny_llama):
    """SamplingParams.prompt_logprobs (vLLM's offline field): None for the first prompt token,
    then the token's logprob and rank and the top-k, on every output of the request."""
    lm = transformers.AutoModelForCausalLM.from_pretrained(
        tiny_llama, torch_dtype=torch.float32).eval()
    ids = llm.get_tokenizer().encode("The quick brown fox jumps over")
    params = SamplingParams(temperature=0.0, max_tokens=3, prompt_logprobs=2, n=2)
    plain, with_lp = llm.generate([ids, ids], [SamplingParams(temperature=0.0, max_tokens=3,
                                                              n=2), params], use_tqdm=False)
    assert plain.prompt_logprobs is None
    assert [c.token_ids for c in with_lp.outputs] == [c.token_ids for c in plain.outputs]
    got = with_lp.prompt_logprobs
    with torch.no_grad():
        ref = torch.log_softmax(lm(torch.tensor([ids])).logits[0].float(), dim=-1)
    assert got is not None and len(got) == len(ids) and got[0] is None
    for pos, entry in enumerate(got[1:]):
        row, token = ref[pos], ids[pos + 1]
        assert entry[0].token_id == token and len(entry) == 3
        assert entry[0].logprob == pytest.approx(row[token].item(), abs=1e-4)
        assert entry[0].rank == int((row > row[token]).sum()) + 1
        assert [e.token_id for e in entry[1:]] == row.topk(2).indices.tolist()
        assert [e.rank for e in entry[1:]] == [1, 2]
        assert entry[0].decoded == llm.get_tokenizer().decode([token])
    assert len(llm.engine.core.prompt_logprobs) == 0  # nothing kept once the request finished
    (one,) = llm.generate([ids[:1]], SamplingParams(max_tokens=1, prompt_logprobs=0),
                          use_tqdm=False)
    assert one.prompt_logprobs == [None]


@pytest.mark.parametrize("value", [-1, 21])
def test_prompt_logprobs_out_of_range_names_the_field(value):
    with pytest.raises(ValueError, match="prompt_logprobs"):
        SamplingParams(prompt_logprobs=value)
    with pytest.raises(TypeError, match="prompt_logprobs"):
        SamplingParams(prompt_logprobs="3")
