"""Wrong types for SamplingParams / LoRARequest fields fail naming the field (they are msgspec
Structs, which do not check types on construction)."""

from __future__ import annotations

import msgspec
import pytest

from bladellm.lora.request import LoRARequest
from bladellm.sampling_params import GuidedDecodingParams, SamplingParams


@pytest.mark.parametrize("kwargs,name", [
    ({"max_tokens": 2.5}, "max_tokens"),
    ({"max_tokens": True}, "max_tokens"),
    ({"n": 2.5}, "n"),
    ({"n": "2"}, "n"),
    ({"n": True}, "n"),
    ({"temperature": "0"}, "temperature"),
    ({"top_k": 1.5}, "top_k"),
    ({"seed": "1"}, "seed"),
    ({"logprobs": 1.0}, "logprobs"),
    ({"stop_token_ids": ["a"]}, "stop_token_ids"),
    ({"stop_token_ids": 5}, "stop_token_ids"),
    ({"stop": 3}, "stop"),
    ({"ignore_eos": 1}, "ignore_eos"),
    ({"logit_bias": {"a": 1.0}}, "logit_bias"),
    ({"guided_decoding": "json"}, "guided_decoding"),
    ({"guided_decoding": {"bogus": 1}}, "guided_decoding"),
])
def test_wrong_types_name_the_parameter(kwargs, name):
    with pytest.raises((TypeError, ValueError), match=f"^{name}:"):
        SamplingParams(**kwargs)
    with pytest.raises(ValueError):  # still a ValueError for callers that map it to a 400
        SamplingParams(**kwargs)


def test_numbers_are_normalised():
    import numpy as np

    p = SamplingParams(temperature=0, max_tokens=np.int64(3), stop_token_ids=(2, 3), top_k=-1)
    assert type(p.temperature) is float and p.temperature == 0.0
    assert type(p.max_tokens) is int and p.max_tokens == 3
    assert p.stop_token_ids == [2, 3] and p.top_k == 0
    assert SamplingParams(logit_bias={"5": 1, 7: -2.5}).logit_bias is not None


def test_guided_decoding_dict_is_converted():
    p = SamplingParams(guided_decoding={"choice": ["yes", "no"]})
    assert isinstance(p.guided_decoding, GuidedDecodingParams)
    assert p.guided_decoding.kind == "choice"
    with pytest.raises(ValueError, match="exactly one"):
        SamplingParams(guided_decoding={"choice": ["a"], "regex": "a"})


def test_roundtrip_through_msgpack():
    p = SamplingParams(max_tokens=4, temperature=0.5, stop=["x"], logit_bias={3: 1.0},
                       guided_decoding=GuidedDecodingParams(choice=["a"]))
    q = msgspec.msgpack.decode(msgspec.msgpack.encode(p), type=SamplingParams)
    assert q == p


@pytest.mark.parametrize("lora_id", [0, -1])
def test_lora_request_id_must_be_positive(lora_id):
    with pytest.raises(ValueError, match="lora_int_id"):
        LoRARequest("a", lora_id, "/x")


@pytest.mark.parametrize("args,name", [
    (("a", True, "/x"), "lora_int_id"), (("a", 1.0, "/x"), "lora_int_id"),
    (("", 1, "/x"), "lora_name"), (("a", 1, None), "lora_path")])
def test_lora_request_types(args, name):
    with pytest.raises(ValueError, match=name):
        LoRARequest(*args)


def test_lora_request_roundtrip():
    r = LoRARequest("a", 3, "/x")
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(r), type=LoRARequest) == r
