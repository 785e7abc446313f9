"""Workloads: exact token counts with a tokenizer, shared prefixes, file datasets."""

import json

import pytest

from bladellm.bench.datasets import DatasetConfig, build_dataset, parse_range


@pytest.fixture(scope="module")
def tokenizer():
    from tiny_models import train_tokenizer

    return train_tokenizer()


def test_random_prompts_have_exact_token_counts(tokenizer):
    cfg = DatasetConfig("random", num_prompts=20, input_len_range=(5, 60),
                        output_len_range=(3, 9), seed=3)
    reqs = build_dataset(cfg, tokenizer)
    assert len(reqs) == 20
    for r in reqs:
        assert 5 <= r.prompt_len <= 60 and 3 <= r.output_len <= 9
        assert len(tokenizer.encode(r.prompt, add_special_tokens=False)) == r.prompt_len
    assert len({r.prompt_len for r in reqs}) > 5


def test_random_prompts_never_hold_added_tokens(tokenizer):
    """A model's placeholder (LLaVA's ``<image>``, added but not special) in random text would
    be a second image placeholder: the request is refused (HTTP 400) and the bench counts an
    error that the engine did not make."""
    import copy

    tok = copy.deepcopy(tokenizer)
    tok.add_tokens(["<image>"])
    image = tok.convert_tokens_to_ids("<image>")
    assert image not in tok.all_special_ids
    cfg = DatasetConfig("random", num_prompts=200, input_len_range=(30, 60), seed=0)
    reqs = build_dataset(cfg, tok)
    assert not any(image in tok.encode(r.prompt, add_special_tokens=False) for r in reqs)


def test_random_words_without_tokenizer_and_seed_determinism():
    cfg = DatasetConfig("random", num_prompts=5, input_len_range=(10, 10), seed=1)
    a = build_dataset(cfg)
    assert [len(r.prompt.split()) for r in a] == [10] * 5
    assert [r.prompt for r in a] == [r.prompt for r in build_dataset(cfg)]
    cfg.seed = 2
    assert [r.prompt for r in a] != [r.prompt for r in build_dataset(cfg)]


def test_shared_prefix_groups(tokenizer):
    cfg = DatasetConfig("shared_prefix", num_prompts=12, input_len_range=(4, 8),
                        num_groups=3, prefix_len=40, seed=0)
    reqs = build_dataset(cfg, tokenizer)
    systems = {r.system for r in reqs}
    assert len(systems) == 3
    for s in systems:
        assert len(tokenizer.encode(s, add_special_tokens=False)) == 40
        assert sum(r.system == s for r in reqs) == 4
    assert all(44 <= r.prompt_len <= 48 for r in reqs)


def test_jsonl_and_sharegpt(tmp_path):
    jl = tmp_path / "p.jsonl"
    jl.write_text('{"prompt": "a b c", "output_len": 4}\n\n{"prompt": "d e", "system": "s t"}\n')
    reqs = build_dataset(DatasetConfig(f"jsonl:{jl}", num_prompts=4, output_len_range=(9, 9)))
    assert sorted((r.prompt, r.prompt_len, r.output_len) for r in reqs) == [
        ("a b c", 3, 4), ("a b c", 3, 4), ("d e", 4, 9), ("d e", 4, 9)]
    sg = tmp_path / "sg.json"
    sg.write_text(json.dumps([
        {"conversations": [{"from": "human", "value": "why is the sky blue"},
                           {"from": "gpt", "value": "because of Rayleigh scattering"}]},
        {"conversations": [{"from": "human", "value": "only one turn"}]}]))
    reqs = build_dataset(DatasetConfig(f"sharegpt:{sg}", num_prompts=2))
    assert all(r.prompt == "why is the sky blue" and r.output_len == 4 for r in reqs)


def test_bad_specs():
    with pytest.raises(ValueError, match="--dataset"):
        build_dataset(DatasetConfig("nope"))
    with pytest.raises(ValueError, match="--dataset"):
        build_dataset(DatasetConfig("jsonl"))
    assert parse_range("3,7", "--x") == (3, 7) and parse_range("5", "--x") == (5, 5)
    for bad in ("7,3", "0,2", "a,b", "1,2,3"):
        with pytest.raises(ValueError, match="--input_len_range"):
            parse_range(bad, "--input_len_range")


def test_check_dataset_args():
    from bladellm.bench.datasets import check_dataset_args

    check_dataset_args("random")
    check_dataset_args("shared_prefix", 2, 16)
    for spec, kw, flag in [("random", {"num_groups": 2}, "--num_groups"),
                           ("random", {"prefix_len": 8}, "--prefix_len"),
                           ("shared_prefix", {"num_groups": 0}, "--num_groups"),
                           ("shared_prefix", {"prefix_len": -1}, "--prefix_len"),
                           ("bogus", {}, "--dataset"), ("sharegpt", {}, "--dataset"),
                           ("jsonl:/nonexistent/x.jsonl", {}, "--dataset"),
                           ("jsonl:" + __file__, {"input_len_range": (8, 16)},
                            "--input_len_range")]:
        with pytest.raises(ValueError, match="^" + flag):
            check_dataset_args(spec, **kw)
